"""A claimed trial's job, held by its lease: the one loop forked and cluster runners share.

A runner claims a trial (``db.queue.claim``), then :func:`train_leased` launches the trial's
job and renews the lease while it trains; a renewal refused (the experiment was cancelled, or
the lease ran out and another attempt took the trial over) stops the job, so two workers
never train one trial. The runner then completes or fails the trial from the returned trace.
Interleaved experiments hold their trials differently: their one job owns every arm's trial
for its life (``experiments/interleaved.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from traind.contracts.events import EvalEvent, Event, LifecycleEvent, StepEvent
from traind.daemon.db import queue
from traind.metrics.throughput import Throughput, Window

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from sqlalchemy import Engine

    from traind.daemon.runs.supervisor import Supervisor
    from traind.trainer.config import TrainConfig

log = logging.getLogger("traind")
LEASE_SECONDS = 60.0  # a trial whose worker is gone is claimable again this long after
HEARTBEAT_SECONDS = 15.0  # renewals per lease: four, so one slow database write is no loss
# The first steps of a resumed job pay for allocator warm-up and cold caches, not for the arm.
WARMUP_STEPS = 3  # step reports left out of a trial's throughput


@dataclass
class TrialTrace:
    """What one trial job's rank 0 reported (``observe``: an observer of its run), and how
    the job ended (``end``, from the run's ``ended``)."""

    resumed_at: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    state: str | None = None  # completed | failed | stopped
    error: str | None = None
    world_size: int = 1  # from the job's started event
    # The trial's figure: its totals after the warm-up reports (metrics/throughput.py).
    _throughput: Throughput = field(default_factory=Throughput)
    _window: Window = field(default_factory=lambda: Window(skip=WARMUP_STEPS))

    def observe(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self.loss = event.loss
            self._window.add(*self._throughput.observe(event, self.world_size))
        elif isinstance(event, EvalEvent):
            self.val_loss = event.val_loss
        elif isinstance(event, LifecycleEvent) and event.phase == "started":
            self.world_size = int(event.detail.get("world_size", self.world_size))
        elif isinstance(event, LifecycleEvent) and event.phase == "resumed":
            self.resumed_at = event.step

    def end(self, state: str, error: str | None) -> None:
        self.state, self.error = state, error

    def tokens_per_second(self) -> float | None:
        """The job's throughput over its step reports after the first few (all of them when
        there are no more); None if no report could be timed."""
        return self._window.tokens_per_second




async def _nothing(_run_id: int) -> None:
    return None


async def train_leased(runs: Supervisor, engine: Engine, cfg: TrainConfig,
                       claimed: queue.ClaimedTrial | None, *, owner: str,
                       started: Callable[[int], Awaitable[None]] = _nothing,
                       ) -> tuple[int, TrialTrace]:
    """Train ``cfg`` as a trial job and wait for its end, renewing ``claimed``'s lease every
    :data:`HEARTBEAT_SECONDS` (None: a job no trial holds, e.g. a forked experiment's base
    run). ``started`` is awaited with the run id once the job is launched (a runner that can
    be cancelled records it there). Returns the run id and its trace, ended."""
    trace = TrialTrace()
    handle = await runs.submit(cfg, kind="trial", observers=[trace.observe])
    await started(handle.id)
    while not handle.ended.done():
        # asyncio.wait, not wait_for: a timeout must not cancel the run's future.
        await asyncio.wait({handle.ended}, timeout=HEARTBEAT_SECONDS)
        if handle.ended.done() or claimed is None:
            continue
        if not await asyncio.to_thread(
                queue.heartbeat, engine, trial_id=claimed.trial_id, attempt=claimed.attempt,
                owner=owner, lease_seconds=LEASE_SECONDS):
            log.info("trial %d is no longer ours: stopping run %d", claimed.trial_id, handle.id)
            await runs.stop(handle.id)
            await handle.ended
    end = handle.ended.result()
    trace.end(end.state, end.error)
    return handle.id, trace
