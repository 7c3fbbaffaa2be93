"""How long a finished run's series stay in ``/metrics``.

A long-running daemon trains many runs (the A/B scheduler starts one per trial); if every
run-labelled series stayed, each scrape, Prometheus's index and the daemon's memory would grow
with every run it ever trained. So a finished run's series stay for ``seconds`` after it ends
(``metrics.series_retention_seconds``: long enough for Prometheus to scrape their final
values), then leave the registry; the run's totals stay in the database and on the runs page.
Removal is lazy, at the next event or scrape after the deadline, so nothing needs a timer.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

# The default of metrics.series_retention_seconds: 5 minutes outlasts a few missed scrapes at
# the usual 15-60 s intervals, so the final values of a run are always scraped.
RETENTION_SECONDS = 300.0


class Removable(Protocol):
    """A labelled family: prometheus_client's metrics, and BinnedHistogram."""

    def remove(self, *labelvalues: str) -> None: ...


def due(deadlines: Mapping[str, float], now: float) -> list[str]:
    """The runs whose series may leave at ``now``."""
    return [run for run, at in deadlines.items() if at <= now]


class RunSeries:
    """The label sets each run created, per family, and the finished runs' deadlines.

    ``track`` runs on the event loop, ``expire`` also in the scrape's thread: one lock."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self._lock = threading.Lock()
        self._series: dict[str, set[tuple[Removable, tuple[str, ...]]]] = {}
        self._deadlines: dict[str, float] = {}
        self._next = math.inf  # the earliest deadline: each event checks only this

    def track(self, run: str, family: Removable, labels: tuple[str, ...]) -> None:
        with self._lock:
            self._series.setdefault(run, set()).add((family, labels))

    def finished(self, run: str, at: float | None = None) -> None:
        """``run`` ended at ``at`` (now, by the clock, if not given)."""
        with self._lock:
            deadline = (self.clock() if at is None else at) + self.seconds
            self._deadlines[run] = deadline
            self._next = min(self._next, deadline)

    def expire(self) -> list[str]:
        """Remove the series of every run past its deadline; the runs that left."""
        now = self.clock()
        if now < self._next:
            return []
        with self._lock:
            gone = due(self._deadlines, now)
            series = [self._series.pop(run, set()) for run in gone]
            for run in gone:
                del self._deadlines[run]
            self._next = min(self._deadlines.values(), default=math.inf)
        for family, labels in (s for runs in series for s in runs):
            family.remove(*labels)
        return gone

    def runs(self) -> int:
        """Runs that have series now (live, or finished and not yet expired)."""
        with self._lock:
            return len(self._series)


class Expiry:
    """A collector with no families of its own: registered before the training families, it
    expires finished runs' series at the start of every scrape."""

    def __init__(self, registry: CollectorRegistry, expire: Callable[[], object]) -> None:
        self._expire = expire
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self._expire()
        return iter(())
