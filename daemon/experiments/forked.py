"""Forked A/B experiments: every arm a short job of its own, from one starting checkpoint.

Each trial (one arm, one repeat) copies the experiment's starting checkpoint into a fresh folder
and resumes from it, so every arm starts from the same weights, optimizer state, sampler
position and RNG state. The arms of one repeat see the same batches; each repeat draws its own
order of them (``data.order``), so that repeats sample what the data order does. Trials are
claimed from the database queue one at a time, in its balanced order (A B B A ...), so the
machine's slow drift falls on every arm alike. Each job (the base job, every trial) holds one
of the node's experiment slots (``experiments/slots.py``), which interleaved experiments take
too: two experiment jobs at once would only measure each other.

The runner is the node's: one asyncio task per forked experiment, which claims a trial (owner
``node:<pid>``, a 60 s lease renewed every 15 s), launches its job through the run supervisor
(a ``TrialTrace`` observes the job's lead-rank events), awaits the run's ``ended`` and commits
the result. When no trial is left it judges every arm against the
baseline, paired by repeat (``judge``), and stores the verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import re
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traind.contracts.states import EXPERIMENT_ACTIVE
from traind.daemon.db import queue
from traind.daemon.experiments import stats
from traind.daemon.experiments.ab import verdict_record
from traind.daemon.experiments.lease import (
    HEARTBEAT_SECONDS,
    LEASE_SECONDS,
    TrialTrace,
    train_leased,
)
from traind.daemon.experiments.specs import arm_config
from traind.daemon.runs.checkpoints import step_of
from traind.daemon.service import ShuttingDown
from traind.daemon.tasks import KeyedTasks
from traind.trainer.checkpoint import latest
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from sqlalchemy import Engine

    from traind.daemon.experiments.slots import Slots
    from traind.daemon.runs.supervisor import Supervisor

log = logging.getLogger("traind")

MIN_BASE_STEPS = 10
_JOB_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass
class _Current:
    """A running experiment's state the node's cancel needs: its job now, if any."""

    run_id: int | None = None
    cancelled: bool = False


def _job_name(*parts: str) -> str:
    return _JOB_NAME_BAD.sub("-", ".".join(parts))[:64]


def _with_job(cfg: TrainConfig, **job: Any) -> TrainConfig:
    return cfg.model_copy(update={"job": cfg.job.model_copy(update=job)})


def _copy_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """A private copy of the starting checkpoint, verified: the trial writes its own next to
    it, and a torn copy would make the trainer start from scratch without a word."""
    out_dir.mkdir(parents=True, exist_ok=False)
    target = out_dir / checkpoint.name
    if checkpoint.is_dir():  # sharded (dcp_step_N)
        shutil.copytree(checkpoint, target)
    else:
        shutil.copy2(checkpoint, target)
    if latest(out_dir) != target:
        raise ValueError(f"checkpoint {checkpoint} is incomplete or corrupt")
    return target


class ForkedRunner:
    """Runs the node's forked experiments: one task each, trials one at a time."""

    def __init__(self, *, engine: Engine, var_dir: Path, runs: Supervisor, slots: Slots,
                 on_end: Callable[[], None] = lambda: None) -> None:
        """``slots``: the node's experiment slots (one per job it runs); ``on_end``: called
        each time one of its experiments' runners has ended."""
        self.engine, self.var_dir, self.runs, self.slots = engine, var_dir, runs, slots
        self._on_end = on_end
        self.owner = f"node:{os.getpid()}"
        self._tasks: KeyedTasks[int] = KeyedTasks("forked")
        self._current: dict[int, _Current] = {}

    def start(self, experiment_id: int) -> None:
        current = _Current()
        def done() -> None:
            self._current.pop(experiment_id, None)
            self._on_end()

        if self._tasks.start(experiment_id, lambda: self._run(experiment_id), on_done=done):
            self._current[experiment_id] = current

    def running(self) -> list[int]:
        return self._tasks.keys()

    async def wait(self, experiment_id: int) -> None:
        """Until the experiment's runner has finished (tests; a no-op when none runs)."""
        await self._tasks.wait(experiment_id)

    def cancel(self, experiment_id: int) -> None:
        """The experiment was cancelled in the database: ask its job to stop now, without
        waiting for the exit (the runner then finds no trial left and ends without a
        verdict; ``wait`` waits for that)."""
        current = self._current.get(experiment_id)
        if current is None:
            return
        current.cancelled = True
        if current.run_id is not None:
            self.runs.request_stop(current.run_id)

    async def close(self) -> None:
        """Node shutdown: end every runner before the node stops the jobs, so none launches
        the next trial meanwhile. Their trials keep their leases, which run out."""
        await self._tasks.close()

    async def _stop(self, run_id: int) -> None:
        await self.runs.stop(run_id)

    # -- one experiment --------------------------------------------------------------------

    async def _run(self, experiment_id: int) -> None:
        engine = self.engine
        current = self._current[experiment_id]
        try:
            view = await asyncio.to_thread(queue.get_experiment, engine,
                                           experiment_id=experiment_id)
            if view is None or view.state not in EXPERIMENT_ACTIVE:
                return
            base = TrainConfig.model_validate(view.base_config)
            folder = self.var_dir / "experiments" / str(experiment_id)
            checkpoint: Path | None = None
            if view.budget.get("checkpoint"):
                checkpoint = Path(view.budget["checkpoint"])
            else:
                async with self.slots.hold(experiment_id):
                    checkpoint = await self._base_checkpoint(view, base, folder, current)
            while checkpoint is not None and not current.cancelled:
                # The slot is taken before the claim, so a trial's lease does not run out
                # while it waits for another experiment's job.
                async with self.slots.hold(experiment_id):
                    claimed = None if current.cancelled else await asyncio.to_thread(
                        queue.claim, engine, owner=self.owner, lease_seconds=LEASE_SECONDS,
                        experiment_id=experiment_id)
                    if claimed is not None:
                        await self._trial(view, base, claimed, checkpoint, folder, current)
                        continue
                trials = await asyncio.to_thread(queue.list_trials, engine,
                                                 experiment_id=experiment_id)
                if current.cancelled or not any(t.state == "running" for t in trials):
                    break
                # Held by a worker that is gone (a previous daemon): claim retakes it once
                # its lease runs out.
                await asyncio.sleep(HEARTBEAT_SECONDS)
            if checkpoint is not None and not current.cancelled:
                await asyncio.to_thread(self._finish, experiment_id)
        except asyncio.CancelledError:
            raise
        except ShuttingDown:  # its claimed trial's lease runs out: the next start retakes it
            log.info("forked experiment %d waits for the next start", experiment_id)
        except Exception as exc:  # a bug or a broken database: end it, do not leave it running
            log.exception("forked experiment %d failed", experiment_id)
            await asyncio.to_thread(self._fail_all, experiment_id, f"runner failed: {exc}")

    async def _launch(self, cfg: TrainConfig, current: _Current,
                      claimed: queue.ClaimedTrial | None = None) -> tuple[int, TrialTrace]:
        """Run ``cfg`` as a job of the node and wait for its end, holding the trial's lease
        (experiments/lease.py). The caller holds the slot."""
        async def started(run_id: int) -> None:
            current.run_id = run_id
            if current.cancelled:  # cancelled while the job was launching
                await self._stop(run_id)

        try:
            return await train_leased(self.runs, self.engine, cfg, claimed, owner=self.owner,
                                      started=started)
        finally:
            current.run_id = None

    async def _base_checkpoint(self, view: queue.ExperimentView, base: TrainConfig,
                               folder: Path, current: _Current) -> Path | None:
        """The starting checkpoint, made by a short job of the base config (every arm then
        starts from it). None when that job did not complete (the experiment is failed)."""
        steps = int(view.budget.get("base_steps") or MIN_BASE_STEPS)
        out = folder / "base"
        found = await asyncio.to_thread(latest, out)  # a previous daemon may have made it
        if found is not None and step_of(found) == steps:
            return found
        if current.cancelled:
            return None
        cfg = _with_job(base, steps=steps, out_dir=out, resume=True,
                        name=_job_name(base.job.name, "base"))
        run_id, trace = await self._launch(cfg, current)
        found = await asyncio.to_thread(latest, out)
        if trace.state == "completed" and found is not None:
            return found
        if not current.cancelled:
            await asyncio.to_thread(
                self._fail_all, view.id,
                f"the base job (run {run_id}) that makes the starting checkpoint "
                f"{trace.state}: {trace.error or 'no checkpoint'}")
        return None

    async def _trial(self, view: queue.ExperimentView, base: TrainConfig,
                     claimed: queue.ClaimedTrial, checkpoint: Path, folder: Path,
                     current: _Current) -> None:
        engine = self.engine
        index = next(i for i, a in enumerate(view.arms) if a["id"] == claimed.arm_id)
        arm = view.arms[index]
        steps = int(view.budget["steps"])
        out = folder / f"trial-{claimed.trial_id}-{claimed.attempt}"
        try:
            start = step_of(checkpoint)
            cfg = arm_config(base, {"name": arm["name"], **arm["overrides"]}, index=index)
            await asyncio.to_thread(_copy_checkpoint, checkpoint, out)
        except (OSError, ValueError) as exc:
            await asyncio.to_thread(queue.fail, engine, trial_id=claimed.trial_id,
                                    attempt=claimed.attempt, error=str(exc))
            return
        # Same seed as the base, and the repeat's own data order (data.order): the arms of a
        # repeat see the same batches from the copied sampler position (paired), and each
        # repeat other ones. With one order for all, the repeats of an arm were copies of
        # each other (same weights, batches and RNG: only thread timing differed), so their
        # spread measured nothing the paired test needs.
        cfg = _with_job(cfg, out_dir=out, steps=start + steps, resume=True,
                        name=_job_name(base.job.name, arm["name"], f"r{claimed.repeat}"))
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"order": claimed.repeat + 1})})
        run_id, trace = await self._launch(cfg, current, claimed)
        tps = trace.tokens_per_second()
        error: str | None = None
        if trace.state != "completed":
            error = f"run {run_id} {trace.state}: {trace.error or 'no error reported'}"
        elif trace.resumed_at != start:  # it trained from elsewhere: not comparable
            error = f"run {run_id} resumed at step {trace.resumed_at}, not {start}"
        elif tps is None:
            error = f"run {run_id} reported no step timings"
        if error is not None:
            await asyncio.to_thread(queue.fail, engine, trial_id=claimed.trial_id,
                                    attempt=claimed.attempt, error=error)
            return
        await asyncio.to_thread(queue.complete, engine, trial_id=claimed.trial_id,
                                attempt=claimed.attempt, result={
                                    "tokens_per_second": tps, "loss": trace.loss,
                                    "val_loss": trace.val_loss, "run_id": run_id,
                                    "resumed_from": start, "steps": steps,
                                    "checkpoint": str(checkpoint)})

    # -- the end (blocking: run in a thread) -----------------------------------------------

    def _finish(self, experiment_id: int) -> None:
        engine = self.engine
        view = queue.get_experiment(engine, experiment_id=experiment_id)
        if view is None or view.state not in EXPERIMENT_ACTIVE:
            return  # cancelled meanwhile
        trials = queue.list_trials(engine, experiment_id=experiment_id)
        arms = [a["name"] for a in sorted(view.arms, key=lambda a: not a["is_baseline"])]
        budget = view.budget
        verdict = judge(arms, trials, loss_margin=float(budget.get("loss_margin", 0.05)),
                        min_effect=float(budget.get("min_effect", stats.DEFAULT_MIN_EFFECT)),
                        equivalence=float(budget.get("equivalence",
                                                     stats.DEFAULT_EQUIVALENCE)))
        state = "done" if any(t.state == "done" for t in trials) else "failed"
        queue.finish_experiment(engine, experiment_id=experiment_id, verdict=verdict,
                                state=state)

    def _fail_all(self, experiment_id: int, error: str) -> None:
        view = queue.get_experiment(self.engine, experiment_id=experiment_id)
        if view is None:
            return
        verdict = {a["name"]: _failed(error) for a in view.arms if not a["is_baseline"]}
        queue.finish_experiment(self.engine, experiment_id=experiment_id,
                                verdict=verdict, state="failed")


# --- the verdict (pure) ---------------------------------------------------------------------




def _failed(error: str, pairs: int = 0) -> dict[str, Any]:
    return {"kind": "failed (error)", "pairs": pairs, "ratio": None, "low": None, "high": None,
            "p_value": None, "reason": f"failed: {error}", "quality": None}


def judge(arms: Sequence[str], trials: Sequence[queue.TrialView], *, loss_margin: float,
          alpha: float = stats.DEFAULT_ALPHA, min_effect: float = stats.DEFAULT_MIN_EFFECT,
          equivalence: float = stats.DEFAULT_EQUIVALENCE) -> dict[str, dict[str, Any]]:
    """Per non-baseline arm (``arms[0]`` is the baseline), its verdict from the finished
    trials, in the shape of ``daemon.ab.evaluate``'s. Trials pair by repeat: when every repeat
    has both arms, a paired t interval on the per-repeat log ratios; otherwise (a trial
    failed) Welch's unpaired interval on what finished. Read once, at the end.

    Quality is required here: each arm trained weights of its own from one checkpoint on the
    same batches, so its final validation loss (a fixed held-out set) against the baseline's
    is the evidence the tuner's quality rounds rest on. A faster arm whose loss is not yet
    shown non-inferior is ``not shown (budget spent)``, not rejected."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms[1:]:
        try:
            out[arm] = _judge_arm(arms[0], arm, trials, loss_margin=loss_margin, alpha=alpha,
                                  min_effect=min_effect, equivalence=equivalence)
        except ValueError as exc:  # e.g. a throughput that is not > 0: say so, do not crash
            out[arm] = _failed(str(exc))
    return out


def _judge_arm(baseline: str, arm: str, trials: Sequence[queue.TrialView], *,
               loss_margin: float, alpha: float, min_effect: float,
               equivalence: float) -> dict[str, Any]:
    done = {(t.arm_name, t.repeat): t.result for t in trials
            if t.state == "done" and t.result is not None}
    errors = [t.error or "failed" for t in trials
              if t.arm_name in (baseline, arm) and t.state == "failed"]
    repeats = sorted({t.repeat for t in trials})
    both = [r for r in repeats if (baseline, r) in done and (arm, r) in done]
    base_runs = [done[(baseline, r)] for r in repeats if (baseline, r) in done]
    arm_runs = [done[(arm, r)] for r in repeats if (arm, r) in done]
    if not base_runs or not arm_runs:
        who = baseline if not base_runs else arm
        return _failed(f"no {who} trial finished ({errors[0] if errors else 'none ran'})")
    paired = len(both) == len(repeats) and len(both) >= 2
    if paired:
        base_runs = [done[(baseline, r)] for r in both]
        arm_runs = [done[(arm, r)] for r in both]
    b = [float(r["tokens_per_second"]) for r in base_runs]
    a = [float(r["tokens_per_second"]) for r in arm_runs]
    left_out = f"; {len(errors)} failed trial(s) left out" if errors else ""
    if len(a) < 2 or len(b) < 2:
        ratio = math.exp(statistics.fmean(math.log(x) for x in a)
                         - statistics.fmean(math.log(x) for x in b))
        return {"kind": "inconclusive (budget spent)", "pairs": len(both), "ratio": ratio,
                "low": None, "high": None, "p_value": None, "quality": None,
                "reason": f"{len(a)} {arm} and {len(b)} {baseline} trial(s) finished: "
                          f"ratio {ratio:.3f}, but an interval needs at least 2 of each; "
                          f"run more repeats{left_out}"}
    speed = stats.speedup(b, a, paired=paired)
    # A forked verdict is read once, at the end of a fixed number of repeats: the fixed
    # interval is valid there, and the always-valid test (built for peeking) could not
    # decide on a handful of pairs however clear they are.
    seq = None
    quality = _quality(base_runs, arm_runs, margin=loss_margin, paired=paired)
    v = stats.verdict(speed=speed, sequential=seq, quality=quality, budget_spent=True,
                      alpha=alpha, min_effect=min_effect, equivalence=equivalence,
                      quality_required=True, arm=arm, baseline=baseline)
    return verdict_record(v, pairs=len(both), suffix=left_out)


def _quality(base_runs: Sequence[dict[str, Any]], arm_runs: Sequence[dict[str, Any]], *,
             margin: float, paired: bool) -> stats.NonInferiority | None:
    """Final validation losses at equal steps: the arm's may exceed the baseline's by at most
    ``margin``. None when fewer than two of either side have one."""
    def loss(r: dict[str, Any]) -> float | None:
        v = r.get("val_loss")
        return float(v) if v is not None and math.isfinite(float(v)) else None

    if paired:
        pairs = [(x, y) for rb, ra in zip(base_runs, arm_runs, strict=True)
                 if (x := loss(rb)) is not None and (y := loss(ra)) is not None]
        b, a = [x for x, _ in pairs], [y for _, y in pairs]
    else:
        b = [x for r in base_runs if (x := loss(r)) is not None]
        a = [y for r in arm_runs if (y := loss(r)) is not None]
    if len(a) < 2 or len(b) < 2:
        return None
    return dataclasses.replace(stats.non_inferior(b, a, margin=margin, paired=paired),
                               measure="validation loss")
