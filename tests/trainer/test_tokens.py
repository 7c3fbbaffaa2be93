"""What a run trains on: prepared shards (windows inside one shard, the same resumable sampler,
a fixed validation set), a BPE-tokenized corpus, and a model vocabulary that follows the
tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from traind.contracts.events import DataEvent, StepEvent
from traind.data.manifest import Manifest, TokenizerInfo, write_manifest
from traind.data.shards import ShardSet, write_shard
from traind.errors import FieldErrors
from traind.trainer.config import DataConfig, TrainConfig
from traind.trainer.data import BatchSampler, val_batches
from traind.trainer.loop import train
from traind.trainer.sink import ListSink
from traind.trainer.tokens import load_tokens
from traind.trainer.vocab import data_vocab, fit_vocab

if TYPE_CHECKING:
    from collections.abc import Callable

VOCAB = 1000


def _prepared(folder: Path, *, shards: tuple[int, ...] = (300, 50, 400), val: int = 200,
              complete: bool = True) -> dict[str, list[np.ndarray]]:
    """A prepared folder written with the format's own writer: train shards of the given
    lengths (ids counting up, so a window's place is readable from its ids), one val shard."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    entries: dict[str, list] = {"train": [], "val": []}
    start = 0
    for split, lengths in (("train", shards), ("val", (val,))):
        for i, n in enumerate(lengths):
            ids = (np.arange(start, start + n) % VOCAB).astype(np.uint16)
            start += n
            arrays[split].append(ids)
            entries[split].append(write_shard(folder, split, i, ids, "uint16"))
    if complete:
        write_manifest(folder, Manifest(
            TokenizerInfo("bpe", VOCAB, "h" * 32, None, eos_id=VOCAB - 1), "uint16", entries,
            documents={"train": 7, "val": 1},
            report={"removed": {"near_duplicate": {"documents": 3, "bytes": 120, "tokens": 40},
                                "low_entropy": {"documents": 1, "bytes": 9, "tokens": 2}}}))
    return arrays


def test_windows_stay_inside_one_shard_and_cover_every_start(tmp_path: Path) -> None:
    arrays = _prepared(tmp_path)
    shards = ShardSet.open(tmp_path, "train")
    seq = 32
    # 300 - 32 + 50 - 32 + 400 - 32 window starts; every one maps to a slice of one shard
    assert shards.starts(seq) == 268 + 18 + 368
    w = shards.windows(torch.arange(shards.starts(seq)), seq)  # (S, T+1)
    expected = [a[i : i + seq + 1].astype(np.int64) for a in arrays["train"]
                for i in range(len(a) - seq)]
    assert np.array_equal(w.numpy(), np.stack(expected))
    with pytest.raises(IndexError):
        shards.windows(torch.tensor([shards.starts(seq)]), seq)


def test_the_sampler_resumes_at_the_exact_position_on_shards(tmp_path: Path) -> None:
    _prepared(tmp_path)
    shards = ShardSet.open(tmp_path, "train", verify=True)

    def sampler() -> BatchSampler:
        return BatchSampler(shards, batch_size=4, seq_len=16, seed=3, rank=1, world_size=2)

    full = sampler()
    batches = [full.next() for _ in range(6)]
    resumed = sampler()
    first = [resumed.next() for _ in range(3)]
    state = resumed.state_dict()
    again = sampler()
    again.load_state_dict(state)
    rest = [again.next() for _ in range(3)]
    for (x, y), (ex, ey) in zip(first + rest, batches, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert x.dtype == torch.int64 and x.shape == (4, 16)


def test_a_run_reads_its_splits_and_the_filter_report_from_the_shards(tmp_path: Path) -> None:
    _prepared(tmp_path)
    tokens = load_tokens(DataConfig(shards=tmp_path), seq_len=16)
    assert (tokens.tokenizer, tokens.vocab_size, tokens.documents) == ("bpe", VOCAB, 8)
    assert tokens.tokens_kept == 750 + 200 and tokens.corpus is None
    assert tokens.filtered == {"near_duplicate": 3, "low_entropy": 1}
    assert tokens.filtered_bytes == {"near_duplicate": 120, "low_entropy": 9}
    assert tokens.filtered_tokens == {"near_duplicate": 40, "low_entropy": 2}
    fixed = val_batches(tokens.val, batch_size=2, seq_len=16, n_batches=2)
    assert fixed[0][0][0, 0].item() == 750  # the val shard's first id: the fixed set's start


def test_an_unfinished_or_damaged_preparation_is_refused_naming_the_field(
        tmp_path: Path) -> None:
    _prepared(tmp_path / "running", complete=False)
    for cfg in (DataConfig(shards=tmp_path / "running"), DataConfig(shards=tmp_path / "nope")):
        with pytest.raises(FieldErrors) as err:
            load_tokens(cfg, seq_len=16)
        assert err.value.errors[0][0] == ("data", "shards")
    assert "has not finished" in str(_refusal(tmp_path / "running"))
    _prepared(tmp_path / "cut")
    with (tmp_path / "cut" / "train-00001.bin").open("r+b") as f:
        f.truncate(10)
    assert "prepare the data again" in str(_refusal(tmp_path / "cut"))
    _prepared(tmp_path / "short", shards=(10,), val=10)
    assert "no shard of more than model.seq_len" in str(_refusal(tmp_path / "short"))


def _refusal(folder: Path) -> FieldErrors:
    with pytest.raises(FieldErrors) as err:
        load_tokens(DataConfig(shards=folder), seq_len=16)
    return err.value


def test_the_model_vocabulary_follows_the_tokenizer(tmp_path: Path) -> None:
    _prepared(tmp_path)
    cfg = TrainConfig.model_validate({"data": {"shards": str(tmp_path)}})
    assert data_vocab(cfg.data) == VOCAB and fit_vocab(cfg).model.vocab_size == VOCAB
    padded = cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"vocab_size": 1024})})
    assert fit_vocab(padded).model.vocab_size == 1024  # larger: padding rows, kept
    assert fit_vocab(TrainConfig()).model.vocab_size == 256  # bytes
    with pytest.raises(FieldErrors) as err:
        fit_vocab(TrainConfig.model_validate({"data": {"tokenizer": "bpe"}}))
    assert err.value.errors[0][0] == ("data", "tokenizer_file")


def test_a_job_trains_from_prepared_shards_and_reports_them(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    # real text through the byte tokenizer, so the loss can fall: stdlib bytes as ids < 256
    folder = tmp_path / "shards"
    folder.mkdir()
    text = np.frombuffer(Path(shutil.__file__).read_bytes(), dtype=np.uint8)
    cut = len(text) * 9 // 10
    entries = {"train": [write_shard(folder, "train", 0, text[:cut], "uint16")],
               "val": [write_shard(folder, "val", 0, text[cut:], "uint16")]}
    write_manifest(folder, Manifest(TokenizerInfo("bytes", 256, "b" * 32), "uint16", entries,
                                    documents={"train": 1, "val": 1}))
    base = make_config(tmp_path / "run", steps=40)
    cfg = base.model_copy(update={"data": base.data.model_copy(update={"shards": folder})})
    sink = ListSink()
    result = train(cfg, sink)
    losses = [e.loss for e in sink.events if isinstance(e, StepEvent)]
    assert result.step == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    data = [e for e in sink.events if isinstance(e, DataEvent)][-1]
    assert data.tokens_kept == len(text) and data.documents_kept == 2
    assert data.bytes_kept == 0 and data.cache_hits == {}
