from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest
import torch
from pydantic import ValidationError

from traind.trainer.config import DataConfig, TrainConfig
from traind.trainer.corpus_cache import CorpusCache, classify, decode_entry, encode_entry
from traind.trainer.data import (
    BatchSampler,
    build_corpus,
    filter_reason,
    load_corpus,
    split_corpus,
    val_batches,
)
from traind.trainer.loop import train
from traind.trainer.pipeline import DataPipeline
from traind.trainer.prefetch import Prefetcher, prefetch_depth
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


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
    # Three-byte documents: min_doc_bytes=0 keeps them (the default would filter them).
    cfg = DataConfig(paths=[tmp_path / "f.md", tmp_path / "d"], glob="*.txt", min_doc_bytes=0)
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


def test_a_data_order_continues_a_checkpoint_in_its_own_batches() -> None:
    """data.order: a forked trial's repeat resumes at the saved batch index in an order of
    its own, reproducibly; order 0 is the seed's (the hash checkpoints were written with)."""
    import hashlib

    base = _sampler(DATA)
    for _ in range(3):
        base.next()
    state = base.state_dict()

    def resumed(order: int) -> list[torch.Tensor]:
        s = _sampler(DATA, order=order)
        s.load_state_dict(state)
        return [s.next()[0] for _ in range(3)]

    own = [base.next()[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(resumed(0), own, strict=True))
    one, two = resumed(1), resumed(2)
    assert all(torch.equal(a, b) for a, b in zip(one, resumed(1), strict=True))  # reproducible
    assert not any(torch.equal(a, b) for a, b in zip(one, own, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    # order 0's batch seed is the hash of "seed:index", as before data.order existed
    digest = hashlib.blake2b(b"7:3", digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    offsets = torch.randint(0, len(DATA) - 16, (4,), generator=gen)
    assert torch.equal(own[0][:, 0], DATA[offsets].long())


def test_val_batches_are_fixed_and_in_range() -> None:
    val = torch.arange(200, dtype=torch.uint8)
    batches = val_batches(val, batch_size=2, seq_len=16, n_batches=3)
    again = val_batches(val, batch_size=2, seq_len=16, n_batches=3)
    assert len(batches) == 3
    for (x, y), (x2, _) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (2, 16)
        assert torch.equal(x, x2)
    assert batches[0][0][0, 0] == 0 and batches[-1][1][-1, -1] == 199  # spans the whole split
    # a dp rank's share: its rows of every batch, so the shares together are the whole set
    whole = val_batches(val, batch_size=4, seq_len=16, n_batches=3)
    shares = [val_batches(val, batch_size=4, seq_len=16, n_batches=3, rank=r, world_size=2)
              for r in range(2)]
    for i, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([s[i][0] for s in shares]), x)
        assert torch.equal(torch.cat([s[i][1] for s in shares]), y)
    with pytest.raises(ValueError, match="does not split into 3"):
        val_batches(val, batch_size=4, seq_len=16, n_batches=3, rank=0, world_size=3)


# -- filters ------------------------------------------------------------------------------------

TEXT = b"def f(x):\n    return x + 1\n"  # 28 bytes of valid UTF-8


def _crafted(folder: Path) -> DataConfig:
    """One file per filter reason, plus two kept ones (sorted names give the order)."""
    folder.mkdir(exist_ok=True)
    files = {
        "a_keep.txt": TEXT,
        "b_empty.txt": b"",
        "c_nul.txt": b"text with a \0 byte in the middle",
        "d_latin1.txt": "caf\u00e9 au lait, s'il vous pla\u00eet".encode("latin-1"),
        "e_dup.txt": TEXT,
        "f_short.txt": b"tiny",
        "g_keep.txt": "na\u00efve unicode is fine: \u00e9\u00e8".encode(),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return DataConfig(paths=[folder], glob="*.txt", min_doc_bytes=16)


@pytest.mark.parametrize(("raw", "min_bytes", "seen", "reason"), [
    (b"", 16, set(), "empty"),
    (b"abc\0" * 8, 16, set(), "binary"),
    (b"\xff\xfe not utf-8 at all....", 16, set(), "binary"),
    (b"short", 16, set(), "too_short"),
    (b"short", 0, set(), None),
    (TEXT, 16, {classify(TEXT).digest}, "duplicate"),
    (TEXT, 16, set(), None),
])
def test_filter_reason_table(raw: bytes, min_bytes: int, seen: set[str],
                             reason: str | None) -> None:
    assert filter_reason(classify(raw), min_bytes=min_bytes, seen=seen) == reason


def test_filters_count_each_reason(tmp_path: Path) -> None:
    corpus = load_corpus(_crafted(tmp_path / "docs"))
    assert corpus.filtered == {"empty": 1, "binary": 2, "too_short": 1, "duplicate": 1}
    keep = (tmp_path / "docs" / "g_keep.txt").read_bytes()
    assert corpus.data == TEXT + keep and corpus.documents == 2


def test_everything_filtered_says_why(tmp_path: Path) -> None:
    (tmp_path / "e.txt").write_bytes(b"")
    (tmp_path / "s.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"data\.paths.*empty.*1 empty, 1 too_short"):
        build_corpus(DataConfig(paths=[tmp_path], glob="*.txt"))


def test_files_past_the_cap_are_not_read_or_counted(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs").model_copy(update={"max_bytes": 10})
    corpus = load_corpus(cfg)
    assert corpus.data == TEXT[:10] and sum(corpus.filtered.values()) == 0


def test_config_rejects_bad_values_by_field() -> None:
    for field, value in [("prefetch", -1), ("min_doc_bytes", -5), ("cache_dir", 3)]:
        with pytest.raises(ValidationError, match=rf"data\.{field}"):
            TrainConfig.model_validate({"data": {field: value}})


def test_cache_dir_that_is_a_file_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"data\.cache_dir"):
        CorpusCache(tmp_path / "f")


# -- the cache ----------------------------------------------------------------------------------

def test_second_build_in_process_hits_memory(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs")
    cache = CorpusCache()
    first = load_corpus(cfg, cache=cache)
    assert first.cache_hits == {"memory": 0, "disk": 0}
    assert first.cache_misses == {"memory": 7, "disk": 0}  # disk off: never tried
    second = load_corpus(cfg, cache=cache)
    assert second.cache_hits == {"memory": 7, "disk": 0}
    assert second.cache_misses == {"memory": 0, "disk": 0}
    assert second.data == first.data and second.filtered == first.filtered


def test_changed_file_misses(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs")
    cache = CorpusCache()
    load_corpus(cfg, cache=cache)
    (tmp_path / "docs" / "a_keep.txt").write_bytes(TEXT + b"# changed\n")
    again = load_corpus(cfg, cache=cache)
    assert again.cache_misses["memory"] == 1 and again.data.startswith(TEXT + b"# changed")


def test_fresh_cache_with_the_same_dir_hits_disk(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs").model_copy(update={"cache_dir": tmp_path / "cache"})
    first = load_corpus(cfg)  # builds its own CorpusCache(cfg.cache_dir)
    assert first.cache_misses == {"memory": 7, "disk": 7}
    assert len(list((tmp_path / "cache").glob("*.doc"))) == 7
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # no temp file left behind
    second = load_corpus(cfg)
    assert second.cache_hits == {"memory": 0, "disk": 7}
    assert second.cache_misses == {"memory": 7, "disk": 0}
    assert second.data == first.data and second.filtered == first.filtered


def test_new_process_hits_disk(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs").model_copy(update={"cache_dir": tmp_path / "cache"})
    load_corpus(cfg)
    code = ("import sys; from pathlib import Path; from traind.trainer.config import DataConfig; "
            "from traind.trainer.data import load_corpus; "
            "c = load_corpus(DataConfig(paths=[Path(sys.argv[1])], glob='*.txt', "
            "cache_dir=Path(sys.argv[2]))); print(c.cache_hits['disk'])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "docs"),
                          str(tmp_path / "cache")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


def test_corrupt_disk_entry_is_a_miss_and_rewritten(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs").model_copy(update={"cache_dir": tmp_path / "cache"})
    first = load_corpus(cfg)
    entries = sorted((tmp_path / "cache").glob("*.doc"))
    kept = [p for p in entries if (d := decode_entry(p.read_bytes())) and d.reason is None]
    victim = kept[0]
    good = victim.read_bytes()
    victim.write_bytes(good[:-3] + b"XYZ")  # same length, altered payload
    (entries[-1] if entries[-1] != victim else entries[0]).write_bytes(b"\x00garbage")
    second = load_corpus(cfg)
    assert second.cache_hits["disk"] == 5 and second.cache_misses["disk"] == 2
    assert second.data == first.data
    assert victim.read_bytes() == good  # rewritten
    assert load_corpus(cfg).cache_hits["disk"] == 7


@pytest.mark.parametrize("blob", [b"", b"{}", b'{"version": 1}\n', b"not json\nabc",
                                  encode_entry(classify(TEXT))[:-1]])
def test_decode_entry_rejects_damage(blob: bytes) -> None:
    assert decode_entry(blob) is None


def test_entry_round_trips() -> None:
    for raw in (TEXT, b"", b"\0\0"):
        assert decode_entry(encode_entry(classify(raw))) == classify(raw)


def test_memory_tier_is_bounded(tmp_path: Path) -> None:
    cfg = _crafted(tmp_path / "docs")
    cache = CorpusCache(memory_bytes=40)  # room for one or two small documents
    load_corpus(cfg, cache=cache)
    assert load_corpus(cfg, cache=cache).cache_misses["memory"] > 0
    assert cache.memory_held <= 40


# -- prefetch -----------------------------------------------------------------------------------

def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "traind-prefetch"]


def _same(a: list[tuple[torch.Tensor, torch.Tensor]],
          b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2)
                                    for (x1, y1), (x2, y2) in zip(a, b, strict=True))


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_prefetch_gives_the_same_batches(depth: int) -> None:
    sync = Prefetcher(_sampler(DATA), 0)
    plain = [sync.next() for _ in range(50)]
    with Prefetcher(_sampler(DATA), depth) as ahead:
        assert _same([ahead.next() for _ in range(50)], plain)
    assert not _prefetch_threads()


@pytest.mark.parametrize("depth", [0, 3])
def test_prefetch_resumes_at_the_consumed_batch(depth: int) -> None:
    a = Prefetcher(_sampler(DATA), depth)
    for _ in range(7):
        a.next()
    state = a.state_dict()
    assert state["index"] == 7  # consumed, not produced (the thread is ahead)
    expected = [a.next() for _ in range(10)]
    a.close()
    b = Prefetcher(_sampler(DATA), depth)
    b.next()  # started and running ahead before the restore
    b.load_state_dict(state)
    assert _same([b.next() for _ in range(10)], expected)
    b.close()
    # Interchangeable with the plain sampler's state in both directions (the checkpoint format).
    plain = _sampler(DATA)
    plain.load_state_dict(state)
    assert _same([plain.next() for _ in range(10)], expected)
    assert not _prefetch_threads()


def test_close_joins_the_thread_and_next_restarts_it() -> None:
    p = Prefetcher(_sampler(DATA), 2)
    p.next()
    assert len(_prefetch_threads()) == 1
    p.close()
    p.close()  # twice is fine
    assert not _prefetch_threads()
    assert torch.equal(p.next()[0], _nth(1)[0])  # continues after the consumed batch
    p.close()
    assert not _prefetch_threads()


def _nth(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = _sampler(DATA)
    s.index = i
    return s.next()


def test_thread_is_joined_when_the_block_raises() -> None:
    with pytest.raises(KeyError), Prefetcher(_sampler(DATA), 2) as p:
        p.next()
        raise KeyError("boom")
    assert not _prefetch_threads()


def test_producer_error_reaches_the_caller() -> None:
    p = Prefetcher(_sampler(DATA), 2)
    p.sampler.data = torch.zeros(0, dtype=torch.uint8)  # every draw now fails
    with pytest.raises(RuntimeError, match="prefetch thread"):
        p.next()
    assert not _prefetch_threads() and p.served == 0


def test_queue_depth_and_wait_are_reported() -> None:
    with Prefetcher(_sampler(DATA), 3) as p:
        p.next()  # the first waits on an empty queue
        deadline = time.monotonic() + 10
        while p.ready < 3 and time.monotonic() < deadline:  # let the thread fill the queue
            time.sleep(0.01)
        p.next()
        assert p.last_depth == 3 and p.served == 2
        assert p.depth_sum >= 3 and p.wait_seconds > 0
    sync = Prefetcher(_sampler(DATA), 0)
    sync.next()
    assert sync.last_depth == 0 and sync.served == 1


# -- the pipeline -------------------------------------------------------------------------------

def test_pipeline_stats(tmp_path: Path) -> None:
    big = (TEXT * 200, "hello \u00e9 world, long enough to keep".encode() * 50)
    (tmp_path / "docs").mkdir()
    for i, data in enumerate(big):
        (tmp_path / "docs" / f"k{i}.txt").write_bytes(data)
    (tmp_path / "docs" / "z.txt").write_bytes(b"")
    cfg = DataConfig(paths=[tmp_path / "docs"], glob="*.txt", prefetch=2, val_fraction=0.1)
    with DataPipeline.build(cfg, batch_size=2, seq_len=16, seed=3) as pipe:
        for _ in range(5):
            pipe.next()
        stats = pipe.stats()
    assert not _prefetch_threads()
    assert stats.filtered == {"empty": 1, "binary": 0, "too_short": 0, "duplicate": 0}
    assert stats.documents_kept == 2 and stats.bytes_kept == sum(map(len, big))
    assert stats.cache_misses == {"memory": 3, "disk": 0}
    assert stats.batches_served == 5 and stats.prefetch_capacity == 2
    assert 0 <= stats.prefetch_depth_mean <= 2 and 0 <= stats.prefetch_depth_last <= 2
    assert stats.prefetch_wait_seconds >= 0 and stats.cache_write_errors == 0
    with pytest.raises(AttributeError):
        stats.batches_served = 0  # type: ignore[misc]


def test_failed_cache_writes_are_counted_not_raised(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _crafted(tmp_path / "docs").model_copy(update={"cache_dir": tmp_path / "cache"})
    cache = CorpusCache(cfg.cache_dir)

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    assert load_corpus(cfg, cache=cache).data.startswith(TEXT)
    assert cache.write_errors == 7
    assert not list((tmp_path / "cache").iterdir())  # temp files removed


def test_training_joins_its_prefetch_thread(tmp_path: Path,
                                            make_config: Callable[..., TrainConfig]) -> None:
    train(make_config(None, steps=3), ListSink())
    assert not _prefetch_threads()


def test_the_data_event_carries_exactly_the_pipelines_stats() -> None:
    import dataclasses

    from traind.contracts.events import DataEvent
    from traind.trainer.pipeline import DataStats

    event_fields = {f.name for f in dataclasses.fields(DataEvent)} - {"rank", "step", "time"}
    assert {f.name for f in dataclasses.fields(DataStats)} == event_fields


@pytest.mark.parametrize("pattern", ["../../../../outside-the-corpus/*", "/etc/*", "~/x",
                                     "a/../../b", "..", ""])
def test_a_glob_that_leaves_the_data_folders_is_refused(pattern: str) -> None:
    from pydantic import ValidationError

    from traind.trainer.config import DataConfig

    with pytest.raises(ValidationError, match="glob"):
        DataConfig(glob=pattern)


def test_a_symlink_out_of_the_corpus_is_not_followed(tmp_path: Path) -> None:
    from traind.trainer.config import DataConfig
    from traind.trainer.data import _input_files

    corpus, outside = tmp_path / "corpus", tmp_path / "secret"
    corpus.mkdir()
    outside.mkdir()
    (outside / "key.txt").write_text("root-only secret")
    (corpus / "a.txt").write_text("inside")
    (corpus / "leak.txt").symlink_to(outside / "key.txt")
    (corpus / "dir").symlink_to(outside, target_is_directory=True)
    files = _input_files(DataConfig(paths=[corpus], glob="**/*.txt"))
    assert files == [corpus / "a.txt"]


@pytest.mark.parametrize(("setting", "device", "depth"), [
    ("auto", "cpu", 0),  # the thread costs the CPU's compute a tenth (bench/speed.py)
    ("auto", "cuda", 2),
    (0, "cuda", 0), (3, "cpu", 3),
])
def test_prefetch_depth_by_device(setting: int | str, device: str, depth: int) -> None:
    assert prefetch_depth(setting, device) == depth


def test_prefetch_accepts_auto_and_refuses_other_words() -> None:
    assert DataConfig().prefetch == "auto"
    with pytest.raises(ValidationError, match="prefetch"):
        DataConfig(prefetch="lots")  # type: ignore[arg-type]
