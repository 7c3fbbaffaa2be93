"""The experiment scheduler's state, read from the database at scrape time.

The node hands in plain callables (metrics never imports the daemon's database code): each
returns a ``{state: count}`` map. A failing read reports ``..._collector_success 0`` and the
scrape goes on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.registry import Collector

from traind.contracts.states import EXPERIMENT_STATES
from traind.metrics.catalog import family

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from prometheus_client.core import Metric


class SchedulerCollector(Collector):
    def __init__(self, experiments: Callable[[], dict[str, int]],
                 trials: Callable[[], dict[str, int]],
                 lease_expiries: Callable[[], int] = lambda: 0) -> None:
        self._experiments, self._trials = experiments, trials
        self._expiries = lease_expiries

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        ok = 1.0
        try:
            by_state = self._experiments()
            trials = self._trials()
            exps = family("traind_experiments")
            for state in EXPERIMENT_STATES:
                exps.add_metric([state], by_state.get(state, 0))
            tr = family("traind_experiments_trials")
            for state, n in sorted(trials.items()):
                tr.add_metric([state], n)
            yield exps
            yield tr
            yield family("traind_experiments_queue_depth", trials.get("waiting", 0))
            yield family("traind_experiments_lease_expiries", self._expiries())
        except Exception:
            ok = 0.0
        yield family("traind_scheduler_collector_success", ok)
        yield family("traind_scheduler_collector_duration_seconds",
                     time.perf_counter() - start)
