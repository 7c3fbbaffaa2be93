"""The data pipeline a training run holds: filtered, cached corpus (or prepared shards) -> token
splits -> prefetched batches.

:meth:`DataPipeline.stats` is the one place telemetry reads the pipeline's numbers from, as a
frozen :class:`DataStats` snapshot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from traind.trainer.corpus_cache import CorpusCache
from traind.trainer.data import BatchSampler
from traind.trainer.prefetch import Batch, Prefetcher, prefetch_depth
from traind.trainer.tiers import TIERS, PageCacheSource, Tiers
from traind.trainer.tokens import Tokens, load_tokens

if TYPE_CHECKING:
    from types import TracebackType

    from traind.trainer.config import DataConfig
    from traind.trainer.data import TokenSource


@dataclass(frozen=True, slots=True)
class DataStats:
    """Cumulative since the pipeline was built. Dicts are copies, keyed by every tier
    (``memory``, ``disk``) and every filter reason the data was built with (the corpus's
    four at start, or the prepared shards' report) even at zero, so exported series never
    appear out of nowhere."""

    cache_hits: dict[str, int]
    cache_misses: dict[str, int]
    cache_write_errors: int
    filtered: dict[str, int]
    documents_kept: int
    bytes_kept: int  # of the corpus read at start (0 for prepared shards)
    tokens_kept: int  # train and validation
    filtered_bytes: dict[str, int]  # bytes each filter removed (prepared shards' report)
    filtered_tokens: dict[str, int]  # tokens each filter removed (prepared shards' report)
    batches_served: int
    prefetch_capacity: int  # data.prefetch
    prefetch_depth_mean: float  # batches ready when the loop asked, averaged over next() calls
    prefetch_depth_last: int
    prefetch_wait_seconds: float  # time next() waited for (or, synchronous, drew) batches
    tier_hits: dict[str, int]  # per cache tier (trainer/tiers.py): device, host, page_cache
    tier_misses: dict[str, int]
    tier_wait_seconds: dict[str, float]


class DataPipeline:
    """Training batches for one rank, plus the validation split.

    Use as a context manager, or call :meth:`close`, so the prefetch thread is joined.
    """

    def __init__(self, tokens: Tokens, cache: CorpusCache, batches: Prefetcher, tiers: Tiers,
                 *, stage_to: torch.device | None = None) -> None:
        self.tokens, self.cache = tokens, cache
        self.train: TokenSource = tokens.train
        self.val: TokenSource = tokens.val
        self.batches = batches
        self.tiers = tiers
        # tier 1: the next batch already copied to this device (CUDA; None: no device tier)
        self.stage_to = stage_to
        self._staged: Batch | None = None

    @classmethod
    def build(cls, cfg: DataConfig, *, batch_size: int, seq_len: int, seed: int,
              rank: int = 0, world_size: int = 1, device: torch.device | None = None,
              cache: CorpusCache | None = None) -> DataPipeline:
        """Read (or recall) the corpus, or open the shards, and set up the sampler; no thread
        starts yet. Pass a ``cache`` to share its memory tier between builds in one process;
        ``device`` decides ``data.prefetch = "auto"``, pinning the host ring and the device
        tier (CUDA only: on the CPU tier 1 is the host ring itself)."""
        device = device if device is not None else torch.device("cpu")
        cache = cache if cache is not None else CorpusCache(cfg.cache_dir)
        tokens = load_tokens(cfg, seq_len=seq_len, cache=cache)
        cuda = device.type == "cuda"
        tiers = Tiers(TIERS if cuda else TIERS[1:])
        source = PageCacheSource(tokens.train, tiers.counts["page_cache"])
        sampler = BatchSampler(source, batch_size=batch_size, seq_len=seq_len, seed=seed,
                               rank=rank, world_size=world_size, order=cfg.order)
        depth = prefetch_depth(cfg.prefetch, device.type)
        batches = Prefetcher(sampler, depth, pin=cuda, counts=tiers.counts["host"])
        return cls(tokens, cache, batches, tiers, stage_to=device if cuda else None)

    def next(self) -> Batch:
        """Inputs and targets, each int64 ``(B, T)`` (on the staging device, if any)."""
        if self.stage_to is None:
            return self.batches.next()
        t0 = time.perf_counter()
        batch, hit = self._staged, self._staged is not None
        if batch is None:
            batch = self._to_device(self.batches.next())
        self.tiers.counts["device"].count(hit, time.perf_counter() - t0)
        # the next batch's copy is queued now, behind this step's inputs and ahead of its
        # kernels' need of it: from pinned memory the host does not wait for it
        self._staged = self._to_device(self.batches.next())
        return batch

    def _to_device(self, batch: Batch) -> Batch:
        assert self.stage_to is not None
        x, y = batch
        return (x.to(self.stage_to, non_blocking=True), y.to(self.stage_to, non_blocking=True))

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the batches the loop consumed (a staged batch was not: a
        resume draws it again). The checkpoint format is unchanged."""
        state = self.batches.state_dict()
        return {**state, "index": state["index"] - (self._staged is not None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._staged = None
        self.batches.load_state_dict(state)

    def stats(self) -> DataStats:
        b, t, c = self.batches, self.tokens, self.tokens.corpus
        hits, misses, waits = self.tiers.snapshot()
        return DataStats(
            cache_hits=dict(c.cache_hits) if c else {},
            cache_misses=dict(c.cache_misses) if c else {},
            cache_write_errors=self.cache.write_errors, filtered=dict(t.filtered),
            documents_kept=t.documents, bytes_kept=len(c.data) if c else 0,
            tokens_kept=t.tokens_kept, filtered_bytes=dict(t.filtered_bytes),
            filtered_tokens=dict(t.filtered_tokens), batches_served=b.served,
            tier_hits=hits, tier_misses=misses, tier_wait_seconds=waits,
            prefetch_capacity=b.depth,
            prefetch_depth_mean=b.depth_sum / b.served if b.served else 0.0,
            prefetch_depth_last=b.last_depth, prefetch_wait_seconds=b.wait_seconds)

    def close(self) -> None:
        self._staged = None
        self.batches.close()

    def __enter__(self) -> DataPipeline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
