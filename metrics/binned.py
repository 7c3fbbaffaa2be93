"""A histogram family fed with counts already binned elsewhere (on the training ranks).

prometheus_client's ``Histogram`` only takes single observations; the trainer sends each
window's latencies as per-bucket counts (see ``traind.trainer.collectives``), so this collector
keeps the cumulative counts and sum per label set and renders them at scrape time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client.core import HistogramMetricFamily

from traind.metrics.catalog import spec

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from prometheus_client import CollectorRegistry


class BinnedHistogram:
    """The catalog histogram ``name``; ``add(labels, counts, total)`` per window, where
    ``counts`` has one entry per catalog bucket plus the +Inf overflow (not cumulative)."""

    def __init__(self, registry: CollectorRegistry, name: str) -> None:
        self.spec = spec(name)
        assert self.spec.kind == "histogram", f"{name} is not a histogram in the catalog"
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], tuple[list[int], float]] = {}
        registry.register(self)

    def add(self, labels: Sequence[str], counts: Sequence[int], total: float) -> None:
        if len(counts) != len(self.spec.buckets) + 1:
            raise ValueError(f"{self.spec.name}: {len(counts)} counts for "
                             f"{len(self.spec.buckets)} buckets and +Inf")
        key = tuple(labels)
        with self._lock:
            old, s = self._series.get(key, ([0] * len(counts), 0.0))
            self._series[key] = ([a + int(b) for a, b in zip(old, counts, strict=True)],
                                 s + total)

    def remove(self, *labels: str) -> None:
        """Drop one label set's series (a finished run's, metrics/retention.py)."""
        with self._lock:
            self._series.pop(tuple(labels), None)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)
        with self._lock:
            series = list(self._series.items())
        for key, (counts, total) in series:
            cumulative, buckets = 0, []
            for bound, n in zip((*self.spec.buckets, float("inf")), counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                                cumulative))
            fam.add_metric(list(key), buckets, total)
        yield fam
