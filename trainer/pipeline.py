"""The data pipeline a training run holds: filtered, cached corpus (or prepared shards) -> token
splits -> prefetched batches.

:meth:`DataPipeline.stats` is the one place telemetry reads the pipeline's numbers from, as a
frozen :class:`DataStats` snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traind.trainer.corpus_cache import CorpusCache
from traind.trainer.data import BatchSampler
from traind.trainer.prefetch import Batch, Prefetcher, prefetch_depth
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
    batches_served: int
    prefetch_capacity: int  # data.prefetch
    prefetch_depth_mean: float  # batches ready when the loop asked, averaged over next() calls
    prefetch_depth_last: int
    prefetch_wait_seconds: float  # time next() waited for (or, synchronous, drew) batches


class DataPipeline:
    """Training batches for one rank, plus the validation split.

    Use as a context manager, or call :meth:`close`, so the prefetch thread is joined.
    """

    def __init__(self, tokens: Tokens, cache: CorpusCache, batches: Prefetcher) -> None:
        self.tokens, self.cache = tokens, cache
        self.train: TokenSource = tokens.train
        self.val: TokenSource = tokens.val
        self.batches = batches

    @classmethod
    def build(cls, cfg: DataConfig, *, batch_size: int, seq_len: int, seed: int,
              rank: int = 0, world_size: int = 1, device_type: str = "cpu",
              cache: CorpusCache | None = None) -> DataPipeline:
        """Read (or recall) the corpus, or open the shards, and set up the sampler; no thread
        starts yet. Pass a
        ``cache`` to share its memory tier between builds in one process; ``device_type``
        decides ``data.prefetch = "auto"``."""
        cache = cache if cache is not None else CorpusCache(cfg.cache_dir)
        tokens = load_tokens(cfg, seq_len=seq_len, cache=cache)
        sampler = BatchSampler(tokens.train, batch_size=batch_size, seq_len=seq_len, seed=seed,
                               rank=rank, world_size=world_size, order=cfg.order)
        depth = prefetch_depth(cfg.prefetch, device_type)
        return cls(tokens, cache, Prefetcher(sampler, depth))

    def next(self) -> Batch:
        """Inputs and targets, each int64 ``(B, T)``."""
        return self.batches.next()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the batches consumed (the checkpoint format is unchanged)."""
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)

    def stats(self) -> DataStats:
        b, t, c = self.batches, self.tokens, self.tokens.corpus
        return DataStats(
            cache_hits=dict(c.cache_hits) if c else {}, cache_misses=dict(c.cache_misses) if c
            else {}, cache_write_errors=self.cache.write_errors, filtered=dict(t.filtered),
            documents_kept=t.documents, bytes_kept=len(c.data) if c else 0,
            tokens_kept=t.tokens_kept, filtered_bytes=dict(t.filtered_bytes),
            batches_served=b.served,
            prefetch_capacity=b.depth,
            prefetch_depth_mean=b.depth_sum / b.served if b.served else 0.0,
            prefetch_depth_last=b.last_depth, prefetch_wait_seconds=b.wait_seconds)

    def close(self) -> None:
        self.batches.close()

    def __enter__(self) -> DataPipeline:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
