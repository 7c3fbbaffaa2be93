"""The data cache's three tiers, counted: the page cache under the shards (a real eviction makes
real misses), the host ring drawn ahead, and the device stage, run here on the CPU device so
the code CUDA takes is the code tested."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from traind.data.manifest import Manifest, TokenizerInfo, write_manifest
from traind.data.shards import ShardSet, write_shard
from traind.trainer.config import DataConfig
from traind.trainer.corpus_cache import CorpusCache
from traind.trainer.data import BatchSampler
from traind.trainer.pipeline import DataPipeline
from traind.trainer.prefetch import Prefetcher
from traind.trainer.tiers import PageCacheSource, TierCounts, Tiers
from traind.trainer.tokens import load_tokens

if TYPE_CHECKING:
    from pathlib import Path


def _shards(folder: Path, tokens: int = 4 * 2**20) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, 50_000, tokens, dtype=np.uint16)
    entries = {"train": [write_shard(folder, "train", 0, ids, "uint16")],
               "val": [write_shard(folder, "val", 0, ids[:4096], "uint16")]}
    write_manifest(folder, Manifest(TokenizerInfo("bpe", 50_000, "x" * 32), "uint16",
                                    entries, documents={"train": 1, "val": 1}))
    return folder


def _evict(path: Path) -> None:
    """Drop the file's clean pages from the page cache (they were fsynced when written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_read_with_a_major_fault_is_a_page_cache_miss() -> None:
    faults = iter([0, 0, 5, 9])  # before/after of two reads: none, then four from disk
    counts = TierCounts()
    source = PageCacheSource(ShardSet([np.arange(100, dtype=np.uint16)]), counts,
                             faults=lambda: next(faults))
    source.windows(torch.tensor([0, 3]), 8)
    source.windows(torch.tensor([1]), 8)
    assert (counts.hits, counts.misses) == (1, 1) and counts.wait_seconds > 0


def test_evicted_shards_miss_the_page_cache_and_then_hit_it(tmp_path: Path) -> None:
    folder = _shards(tmp_path)
    _evict(folder / "train-00000.bin")
    counts = TierCounts()
    source = PageCacheSource(ShardSet.open(folder, "train"), counts)
    offsets = torch.linspace(0, source.starts(64) - 1, 32).long()  # pages all over the file
    source.windows(offsets, 64)
    assert counts.misses == 1 and counts.hits == 0, "read back from disk: a miss"
    source.windows(offsets, 64)
    assert counts.hits == 1 and counts.misses == 1, "the same pages again: in memory"


def test_the_host_ring_hits_when_drawn_ahead_and_misses_on_demand(tmp_path: Path) -> None:
    tokens = load_tokens(DataConfig(shards=_shards(tmp_path, 2**16)), seq_len=32)
    for depth, hit in ((0, False), (2, True)):
        tiers = Tiers(("host", "page_cache"))
        sampler = BatchSampler(tokens.train, batch_size=4, seq_len=32, seed=1)
        batches = Prefetcher(sampler, depth, counts=tiers.counts["host"])
        with DataPipeline(tokens, CorpusCache(), batches, tiers) as p:
            p.next()  # the first batch starts the thread: waited for either way
            for _ in range(5):
                time.sleep(0.02)  # a step's compute, while the thread draws ahead
                p.next()
            hits, misses, _ = tiers.snapshot()
        assert (hits["host"], misses["host"]) == ((5, 1) if hit else (0, 6)), depth


def test_the_device_stage_serves_the_same_batches_and_resumes_exactly(
        tmp_path: Path) -> None:
    tokens = load_tokens(DataConfig(shards=_shards(tmp_path, 2**16)), seq_len=32)

    def pipeline(stage: bool) -> DataPipeline:
        sampler = BatchSampler(tokens.train, batch_size=4, seq_len=32, seed=1)
        active = ("device", "host", "page_cache") if stage else ("host", "page_cache")
        return DataPipeline(tokens, CorpusCache(), Prefetcher(sampler, 0), Tiers(active),
                            stage_to=torch.device("cpu") if stage else None)

    unstaged = pipeline(False)
    plain = [unstaged.next() for _ in range(8)]
    staged = pipeline(True)
    first = [staged.next() for _ in range(4)]
    state = staged.state_dict()
    assert state["index"] == 4, "the staged fifth batch was not consumed"
    hits, misses, _ = staged.tiers.snapshot()
    assert (hits["device"], misses["device"]) == (3, 1)
    resumed = pipeline(True)
    resumed.load_state_dict(state)
    rest = [resumed.next() for _ in range(4)]
    for (x, y), (ex, ey) in zip(first + rest, plain, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_the_batch_that_starts_the_thread_is_a_miss_however_fast_the_thread_is(
        tmp_path: Path) -> None:
    """The race CI once lost: the new thread put its first batch before next() looked."""
    tokens = load_tokens(DataConfig(shards=_shards(tmp_path, 2**16)), seq_len=32)

    class FastThread(Prefetcher):
        def _start(self) -> None:
            super()._start()
            while self._queue.qsize() == 0:  # the thread wins the race every time
                time.sleep(0.001)

    counts = TierCounts()
    with FastThread(BatchSampler(tokens.train, batch_size=4, seq_len=32, seed=1), 2,
                    counts=counts) as batches:
        batches.next()
    assert (counts.hits, counts.misses) == (0, 1)
