"""The data cache's tiers, counted per batch the loop asks for: hits, misses and the time spent
in each.

- ``page_cache`` (tier 3, the SSD behind the OS page cache): a batch's windows read from the
  token source. A draw that took a *major* page fault on its thread read from disk: a miss;
  one that did not was served from memory (the page cache, or a corpus held in RAM): a hit.
  Faults are counted per thread (``RUSAGE_THREAD``), so the prefetch thread's reads are its own.
- ``host`` (tier 2): the ring of batches drawn ahead in host memory (``trainer/prefetch.py``;
  pinned for CUDA). A batch already waiting when the loop asks is a hit; with ``data.prefetch``
  0 every batch is drawn on demand, a miss.
- ``device`` (tier 1, CUDA): the next batch copied to the device ahead of the step
  (``trainer/pipeline.py``). On the CPU tier 1 is the host ring itself and is not counted.

The wait of a tier is the time the loop (or the reading thread) spent on the batches that tier
missed.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from traind.trainer.data import TokenSource

TIERS = ("device", "host", "page_cache")


def major_faults() -> int:
    """Major page faults of the calling thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


@dataclass(slots=True)
class TierCounts:
    hits: int = 0
    misses: int = 0
    wait_seconds: float = 0.0

    def count(self, hit: bool, seconds: float) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
            self.wait_seconds += seconds


@dataclass(slots=True)
class Tiers:
    """Every tier's counts; ``active`` lists those this pipeline has (no device tier on CPU)."""

    active: tuple[str, ...]
    counts: dict[str, TierCounts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = {t: TierCounts() for t in self.active}

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
        return ({t: c.hits for t, c in self.counts.items()},
                {t: c.misses for t, c in self.counts.items()},
                {t: c.wait_seconds for t, c in self.counts.items()})


class PageCacheSource:
    """A token source whose reads are counted as tier 3 (see the module doc)."""

    def __init__(self, source: TokenSource, counts: TierCounts,
                 faults: Callable[[], int] = major_faults) -> None:
        self.source, self.counts, self._faults = source, counts, faults
        self.tokens = source.tokens

    def starts(self, seq_len: int) -> int:
        return self.source.starts(seq_len)

    def windows(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
        before, t0 = self._faults(), time.perf_counter()
        out = self.source.windows(offsets, seq_len)
        self.counts.count(self._faults() == before, time.perf_counter() - t0)
        return out
