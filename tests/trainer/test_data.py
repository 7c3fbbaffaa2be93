from __future__ import annotations

from pathlib import Path

import pytest
import torch

from traind.trainer.config import DataConfig
from traind.trainer.data import BatchSampler, build_corpus, split_corpus, val_batches


def test_default_corpus_is_the_stdlib_and_deterministic() -> None:
    corpus = build_corpus(DataConfig(max_bytes=2_000_000))
    assert len(corpus) == 2_000_000
    assert b"def " in corpus and b"import " in corpus
    assert build_corpus(DataConfig(max_bytes=2_000_000)) == corpus


def test_user_files_and_folders(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_bytes(b"bbb")
    (tmp_path / "d" / "a.txt").write_bytes(b"aaa")
    (tmp_path / "d" / "skip.bin").write_bytes(b"zzz")
    (tmp_path / "f.md").write_bytes(b"fff")
    cfg = DataConfig(paths=[tmp_path / "f.md", tmp_path / "d"], glob="*.txt")
    assert build_corpus(cfg) == b"fffaaabbb"  # given order, folder contents sorted
    assert build_corpus(cfg.model_copy(update={"max_bytes": 5})) == b"fffaa"


def test_missing_path_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.paths.*nope"):
        build_corpus(DataConfig(paths=[tmp_path / "nope"]))


def test_corpus_too_small_for_one_window() -> None:
    with pytest.raises(ValueError, match=r"data\.paths.*too small"):
        split_corpus(b"x" * 100, 0.1, seq_len=32)
    train, val = split_corpus(b"x" * 1000, 0.1, seq_len=32)
    assert (len(train), len(val)) == (900, 100)


def _sampler(data: torch.Tensor, **kw: int) -> BatchSampler:
    args = {"batch_size": 4, "seq_len": 16, "seed": 7, "rank": 0, "world_size": 1} | kw
    return BatchSampler(data, **args)


DATA = torch.randint(0, 256, (5000,), dtype=torch.uint8)


def test_targets_are_inputs_shifted() -> None:
    x, y = _sampler(DATA).next()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_sampler_resumes_at_the_same_position() -> None:
    a = _sampler(DATA)
    for _ in range(3):
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(4)]
    b = _sampler(DATA)
    b.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(expected, (b.next() for _ in range(4)), strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(_sampler(DATA).next()[0], expected[0][0])  # it did move on


def test_ranks_draw_disjoint_slices_of_one_global_batch() -> None:
    r0 = _sampler(DATA, rank=0, world_size=2).next()[0]
    r1 = _sampler(DATA, rank=1, world_size=2).next()[0]
    assert not torch.equal(r0, r1)
    whole = _sampler(DATA, batch_size=8).next()[0]
    assert torch.equal(torch.cat([r0, r1]), whole)


def test_seeds_differ() -> None:
    assert not torch.equal(_sampler(DATA, seed=1).next()[0], _sampler(DATA, seed=2).next()[0])


def test_val_batches_are_fixed_and_in_range() -> None:
    val = torch.arange(200, dtype=torch.uint8)
    batches = val_batches(val, batch_size=2, seq_len=16, n_batches=3)
    again = val_batches(val, batch_size=2, seq_len=16, n_batches=3)
    assert len(batches) == 3
    for (x, y), (x2, _) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (2, 16)
        assert torch.equal(x, x2)
    assert batches[0][0][0, 0] == 0 and batches[-1][1][-1, -1] == 199  # spans the whole split
