"""Promotions: a tuned setting handed to a long-running job, watched, and rolled back if bad.

A promotion is written as a control message (``contracts/control.py``) into the run's folder;
the job applies it at its next checkpoint boundary and says so with a ``promoted`` lifecycle
event. From then on the guard compares the job's steps after the change with the steps just
before it (:func:`judge`, pure) and rolls the change back, by a second control message with
the previous setting, on a non-finite loss, a loss spike or a slowdown. The row keeps the
setting, the previous one, the evidence that chose it, and why it was undone; its queries
are ``daemon/db/promotions.py``'s, this module decides and writes the messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from traind.contracts.control import FILENAME, Control, write_control
from traind.contracts.events import Event, LifecycleEvent, StepEvent
from traind.daemon.db import promotions as db
from traind.metrics.throughput import Throughput, rate

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from sqlalchemy import Engine

log = logging.getLogger(__name__)
Action = Literal["wait", "keep", "rollback"]


@dataclass(frozen=True, slots=True)
class Sample:
    step: int
    loss: float
    tokens_per_second: float  # the job's, over the interval the report closes (0: untimed)


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """``before``: reports kept from before the change as its reference; ``after``: reports
    watched before a change is kept. A spike is a loss above ``spike_sigmas`` standard
    deviations *and* ``spike_ratio`` x the reference mean (both: a flat loss has a tiny
    deviation, a noisy one a wide one). A slowdown is a median throughput more than
    ``slowdown`` below the reference median: medians, so one slow step (a checkpoint, a
    neighbour) is not a verdict."""

    before: int = 20
    after: int = 20
    spike_sigmas: float = 6.0
    spike_ratio: float = 1.5
    slowdown: float = 0.05


def judge(before: Sequence[Sample], after: Sequence[Sample],
          policy: GuardPolicy = GuardPolicy()) -> tuple[Action, str]:
    """Keep, roll back or wait for more, with the reason in words."""
    for s in after:
        if not math.isfinite(s.loss):
            return "rollback", f"non-finite loss ({s.loss}) at step {s.step}"
    losses = [s.loss for s in before if math.isfinite(s.loss)]
    if len(losses) >= 2:
        mean, sd = statistics.fmean(losses), statistics.stdev(losses)
        limit = max(mean + policy.spike_sigmas * sd, mean * policy.spike_ratio)
        for s in after:
            if s.loss > limit:
                return "rollback", (f"loss spike at step {s.step}: {s.loss:.3f} against "
                                    f"{mean:.3f} +- {sd:.3f} before the change")
    if len(after) < policy.after:
        return "wait", f"{len(after)} of {policy.after} reports after the change"
    speeds = [s.tokens_per_second for s in before if s.tokens_per_second > 0]
    if speeds:
        ref = statistics.median(speeds)
        now = statistics.median(s.tokens_per_second for s in after)
        if now < ref * (1 - policy.slowdown):
            return "rollback", (f"slowdown: median {now:,.0f} tokens/s against {ref:,.0f} "
                                f"before the change ({now / ref - 1:+.1%})")
    return "keep", f"{len(after)} reports after the change: no NaN, no spike, no slowdown"


def current_setting(engine: Engine, run_id: int, config: dict[str, Any]) -> dict[str, Any]:
    """The setting the run trains with now: its last applied or kept promotion's, else its
    config's (``config``: the run's stored TrainConfig)."""
    last = db.last_setting(engine, run_id=run_id)
    if last is not None:
        return last
    return {"precision": config["precision"]["mode"],
            "compression": dict(config["compression"])}


def changes(previous: dict[str, Any], setting: dict[str, Any]) -> bool:
    """Whether ``setting`` differs from ``previous``: fields it leaves out stay as they are
    (``{"method": "none"}`` is the same as a full compression table whose method is none)."""
    if setting.get("precision") not in (None, previous.get("precision")):
        return True
    before = previous.get("compression") or {}
    return any(before.get(k) != v for k, v in (setting.get("compression") or {}).items())


def promote(engine: Engine, *, run_id: int, out_dir: Path, setting: dict[str, Any],
            previous: dict[str, Any], evidence: dict[str, Any],
            autotune_id: int | None = None) -> int:
    """Record a promotion and write its control message; an older one still pending is
    superseded (the job will only ever see the newest message)."""
    def send(seq: int) -> None:
        write_control(out_dir / FILENAME, Control(seq=seq, setting=setting))

    return db.create_promotion(engine, run_id=run_id, setting=setting, previous=previous,
                               evidence=evidence, autotune_id=autotune_id, send=send)


def end(engine: Engine, *, promotion_id: int, out_dir: Path, action: Action,
        reason: str) -> None:
    """Keep the promotion, or roll it back: a new control message with the previous setting."""
    if action == "keep":
        db.mark_kept(engine, promotion_id=promotion_id, reason=reason)
        return

    def send(seq: int, previous: dict[str, Any]) -> None:
        write_control(out_dir / FILENAME, Control(seq=seq, setting=previous))

    db.mark_rolling_back(engine, promotion_id=promotion_id, reason=reason, send=send)


class Guard:
    """Watches runs' rank-0 steps around their promotions (on the event loop; the database
    work goes to threads). ``out_dir(run_id)`` finds a run's folder."""

    def __init__(self, engine: Engine, out_dir: Callable[[int], Path | None],
                 policy: GuardPolicy = GuardPolicy()) -> None:
        self.engine, self.out_dir, self.policy = engine, out_dir, policy
        self._recent: dict[int, deque[Sample]] = {}
        # run -> its rank-0 reports folded (metrics/throughput.py), and its world size
        self._speed: dict[int, tuple[Throughput, int]] = {}
        # run -> (promotion id, samples before it, samples since)
        self._watch: dict[int, tuple[int, list[Sample], list[Sample]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def observe(self, run_id: int, event: Event) -> None:
        if event.rank != 0:
            return
        if isinstance(event, StepEvent):
            sample = self._sample(run_id, event)
            self._recent.setdefault(run_id, deque(maxlen=self.policy.before)).append(sample)
            if run_id in self._watch:
                self._check(run_id, sample)
        elif isinstance(event, LifecycleEvent) and event.phase == "started":  # new workers
            self._speed[run_id] = (Throughput(), int(event.detail.get("world_size", 1)))
        elif isinstance(event, LifecycleEvent) and event.phase == "promoted" \
                and event.detail.get("seq") is not None:
            self._spawn(self._applied(run_id, event))

    def _sample(self, run_id: int, event: StepEvent) -> Sample:
        """The report as the judge reads it: per-interval figures, not the smoothed one
        (smoothing would carry the speed from before a change into the samples after it;
        the judge's medians are its own smoothing)."""
        speed, world = self._speed.setdefault(run_id, (Throughput(), 1))
        tps = rate(*speed.observe(event, world))
        return Sample(event.step, event.loss, 0.0 if math.isnan(tps) else tps)

    async def _applied(self, run_id: int, event: LifecycleEvent) -> None:
        view = await asyncio.to_thread(db.mark_applied, self.engine, run_id=run_id,
                                       seq=int(event.detail["seq"]), step=event.step,
                                       error=event.detail.get("error"))
        # Not for a run that ended meanwhile (forgotten): nothing would ever end the watch.
        if view is not None and view.state == "applied" and run_id in self._speed:
            self._watch[run_id] = (view.id, list(self._recent.get(run_id, ())), [])
        elif view is not None:
            self._watch.pop(run_id, None)

    def _check(self, run_id: int, sample: Sample) -> None:
        promotion_id, before, after = self._watch[run_id]
        after.append(sample)
        action, reason = judge(before, after, self.policy)
        if action == "wait":
            return
        del self._watch[run_id]
        out_dir = self.out_dir(run_id)
        if out_dir is None:
            return
        log.info("promotion %d of run %d: %s (%s)", promotion_id, run_id, action, reason)
        self._spawn(asyncio.to_thread(end, self.engine, promotion_id=promotion_id,
                                      out_dir=out_dir, action=action, reason=reason))

    def forget(self, run_id: int) -> None:
        """Drop a run's state (the daemon calls this when the run ends)."""
        self._recent.pop(run_id, None)
        self._watch.pop(run_id, None)
        self._speed.pop(run_id, None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
