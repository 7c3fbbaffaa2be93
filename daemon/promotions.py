"""Promotions: a tuned setting handed to a long-running job, watched, and rolled back if bad.

A promotion is written as a control message (``contracts/control.py``) into the run's folder;
the job applies it at its next checkpoint boundary and says so with a ``promoted`` lifecycle
event. From then on the guard compares the job's steps and validation losses after the
change with those just before it (``daemon/promotion_guard.py``'s ``judge``, pure: a
sequential test on throughput blocks, the validation loss against its pre-change trend) and
rolls the change back, by a second control message with the previous setting, on evidence of
a slowdown or of harm, a non-finite loss or a sustained divergence. The row keeps the
setting, the previous one, the evidence that chose it, what both rest on (config hash and
versions), and why it was kept or undone. A promotion that sends nothing (nothing beat the
baseline; evidence from another configuration) is a row too (:func:`hand_over`). Its queries
are ``daemon/db/promotions.py``'s; this module decides and writes the messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traind.contracts.control import FILENAME, Control, write_control
from traind.contracts.events import EvalEvent, Event, LifecycleEvent, StepEvent
from traind.daemon.autotune.search import setting_label
from traind.daemon.config import ConfigError
from traind.daemon.db import promotions as db
from traind.daemon.promotion_guard import Action, EvalSample, GuardPolicy, Sample, judge
from traind.daemon.provenance import merged_versions, mismatches
from traind.errors import line
from traind.metrics.throughput import Throughput, rate

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from sqlalchemy import Engine

    from traind.daemon.autotune.search import Plan
    from traind.daemon.provenance import Provenance

# The guard's rule and its inputs live in daemon/promotion_guard.py (pure); named here too
# because this module is where a reader of promotions looks for them.
__all__ = ["Action", "EvalSample", "Guard", "GuardPolicy", "Sample", "changes",
           "current_setting", "end", "hand_over", "judge", "nothing_beat_baseline", "promote"]

log = logging.getLogger(__name__)


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
            autotune_id: int | None = None, stamp: db.Stamp = db.Stamp()) -> int:
    """Record a promotion and write its control message; an older one still pending is
    superseded (the job will only ever see the newest message)."""
    def send(seq: int) -> None:
        write_control(out_dir / FILENAME, Control(seq=seq, setting=setting))

    return db.create_promotion(engine, run_id=run_id, setting=setting, previous=previous,
                               evidence=evidence, autotune_id=autotune_id, send=send,
                               stamp=stamp)


def nothing_beat_baseline(plan: Plan) -> bool:
    """Whether a finished search's best is still its first baseline (the job's own setting,
    never shown better than anything): no round, or no challenger that beat it."""
    return not plan.rounds or plan.best.name == plan.rounds[0].baseline.name


def hand_over(engine: Engine, *, run_id: int, out_dir: Path, config: dict[str, Any],
              setting: dict[str, Any], evidence: dict[str, Any], autotune_id: int | None,
              target: Provenance, evidence_from: Sequence[Provenance] = (),
              baseline: bool = False) -> int | None:
    """The promote path: ``setting`` goes to run ``run_id`` (``config``: its stored
    TrainConfig, ``target``: its provenance) on the strength of ``evidence`` measured as
    ``evidence_from`` says. Returns the promotion's id, or None when nothing was sent:
    ``baseline`` (nothing beat the search's baseline, so there is nothing to promote) or the
    run already trains with the setting; the row says which. Evidence from another
    configuration (``daemon/provenance.py``'s basis) is refused: recorded as ``refused`` and
    raised as a ``ConfigError`` naming each field that differs."""
    previous = current_setting(engine, run_id, config)
    stamp = db.Stamp(target.config_hash, dict(target.versions),
                     evidence_from[0].config_hash if evidence_from else None,
                     merged_versions(evidence_from) if evidence_from else None)

    def unsent(state: str, reason: str) -> None:
        db.record_unsent(engine, run_id=run_id, state=state, setting=setting,
                         previous=previous, evidence=evidence, autotune_id=autotune_id,
                         reason=reason, stamp=stamp)

    problems = mismatches(evidence_from, target)
    if problems:
        err = ConfigError(problems, f"evidence from another configuration than {target.source}"
                          f" is not promoted: {'; '.join(line(*p) for p in problems)}")
        unsent("refused", str(err))
        raise err
    label = setting_label(setting)
    if baseline:
        rounds = len(evidence.get("rounds") or ())
        unsent("unchanged", f"nothing beat the baseline ({label}) in {rounds} round"
               f"{'' if rounds == 1 else 's'}: no setting sent, the run keeps its own")
        return None
    if not changes(previous, setting):
        unsent("unchanged", f"{target.source} already trains with {label}: no setting sent")
        return None
    return promote(engine, run_id=run_id, out_dir=out_dir, setting=setting, previous=previous,
                   evidence=evidence, autotune_id=autotune_id, stamp=stamp)


def end(engine: Engine, *, promotion_id: int, out_dir: Path, action: Action,
        reason: str) -> None:
    """Keep the promotion, or roll it back: a new control message with the previous setting."""
    if action == "keep":
        db.mark_kept(engine, promotion_id=promotion_id, reason=reason)
        return

    def send(seq: int, previous: dict[str, Any]) -> None:
        write_control(out_dir / FILENAME, Control(seq=seq, setting=previous))

    db.mark_rolling_back(engine, promotion_id=promotion_id, reason=reason, send=send)


@dataclass(slots=True)
class _Watch:
    """A promotion being judged: the run's reports before it and since (``judge``'s input)."""

    promotion_id: int
    before: list[Sample]
    evals_before: list[EvalSample]
    after: list[Sample] = field(default_factory=list)
    evals_after: list[EvalSample] = field(default_factory=list)


class Guard:
    """Watches runs' rank-0 steps and validation losses around their promotions (on the
    event loop; the database work goes to threads). ``out_dir(run_id)`` finds a run's
    folder; ``policy`` may be replaced before a run starts (its windows are sized then)."""

    def __init__(self, engine: Engine, out_dir: Callable[[int], Path | None],
                 policy: GuardPolicy = GuardPolicy()) -> None:
        self.engine, self.out_dir, self.policy = engine, out_dir, policy
        self._recent: dict[int, deque[Sample]] = {}
        self._evals: dict[int, deque[EvalSample]] = {}
        # run -> its rank-0 reports folded (metrics/throughput.py), and its world size
        self._speed: dict[int, tuple[Throughput, int]] = {}
        self._watch: dict[int, _Watch] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def observe(self, run_id: int, event: Event) -> None:
        if event.rank != 0:
            return
        if isinstance(event, StepEvent):
            sample = self._sample(run_id, event)
            # Kept while watched too: a watch starts only once its row is read back, and
            # the reports since the change are taken from here then (see _applied).
            self._recent.setdefault(run_id, deque(maxlen=self.policy.before)).append(sample)
            if run_id in self._watch:
                self._watch[run_id].after.append(sample)
                self._check(run_id)
        elif isinstance(event, EvalEvent):
            ev = EvalSample(event.step, event.val_loss)
            self._evals.setdefault(run_id, deque(maxlen=self.policy.trend_evals)).append(ev)
            if run_id in self._watch:
                self._watch[run_id].evals_after.append(ev)
                self._check(run_id)
        elif isinstance(event, LifecycleEvent) and event.phase == "started":  # new workers
            self._speed[run_id] = (Throughput(), int(event.detail.get("world_size", 1)))
        elif isinstance(event, LifecycleEvent) and event.phase == "promoted" \
                and event.detail.get("seq") is not None:
            self._spawn(self._applied(run_id, event))

    def _sample(self, run_id: int, event: StepEvent) -> Sample:
        """The report as the judge reads it: per-interval figures, not the smoothed one
        (smoothing would carry the speed from before a change into the samples after it;
        the judge's block medians are its own smoothing)."""
        speed, world = self._speed.setdefault(run_id, (Throughput(), 1))
        tps = rate(*speed.observe(event, world))
        return Sample(event.step, event.loss, 0.0 if math.isnan(tps) else tps)

    async def _applied(self, run_id: int, event: LifecycleEvent) -> None:
        view = await asyncio.to_thread(db.mark_applied, self.engine, run_id=run_id,
                                       seq=int(event.detail["seq"]), step=event.step,
                                       error=event.detail.get("error"))
        # Not for a run that ended meanwhile (forgotten): nothing would ever end the watch.
        if view is not None and view.state == "applied" and run_id in self._speed:
            # Split at the step the change took effect: reports that came in while the row
            # was read back belong after it, not in the reference.
            at, recent = event.step, list(self._recent.get(run_id, ()))
            evals = list(self._evals.get(run_id, ()))
            self._watch[run_id] = _Watch(
                view.id, [s for s in recent if s.step <= at], [e for e in evals if e.step <= at],
                [s for s in recent if s.step > at], [e for e in evals if e.step > at])
            self._check(run_id)
        elif view is not None:
            self._watch.pop(run_id, None)

    def _check(self, run_id: int) -> None:
        w = self._watch[run_id]
        action, reason = judge(w.before, w.after, self.policy, evals_before=w.evals_before,
                               evals_after=w.evals_after)
        if action == "wait":
            return
        del self._watch[run_id]
        out_dir = self.out_dir(run_id)
        if out_dir is None:
            return
        log.info("promotion %d of run %d: %s (%s)", w.promotion_id, run_id, action, reason)
        self._spawn(asyncio.to_thread(end, self.engine, promotion_id=w.promotion_id,
                                      out_dir=out_dir, action=action, reason=reason))

    def forget(self, run_id: int) -> None:
        """Drop a run's state (the daemon calls this when the run ends)."""
        self._recent.pop(run_id, None)
        self._evals.pop(run_id, None)
        self._watch.pop(run_id, None)
        self._speed.pop(run_id, None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
