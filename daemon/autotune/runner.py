"""The auto-tuner as the node runs it: each round an A/B experiment, the plan stored after each.

``daemon/autotune/search.py`` decides (pure); this module records, submits and waits. A search is a
row in ``autotunes`` whose ``plan`` is rewritten after every round and whose ``spec.current``
names the round in flight, so a daemon that restarts waits for that round's experiment (or
re-runs it if it was lost) and goes on. When the search ends, its winner is promoted into the
target run (``daemon/promotions.py``) if one was named and the winner is not the run's current
setting; the evidence stored with the promotion is every round's verdicts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from traind import __version__
from traind.daemon.autotune import mesh as meshes
from traind.daemon.autotune import search as autotune
from traind.daemon.autotune.search import Candidate, Hardware, Plan, Round, Space
from traind.daemon.config import ConfigError, Settings
from traind.daemon.db import autotunes as db
from traind.daemon.devices import read_devices
from traind.daemon.experiments.ab import interrupted
from traind.daemon.experiments.specs import experiment_config, forked_configs, job_config
from traind.daemon.promotions import nothing_beat_baseline
from traind.daemon.provenance import config_hash, torch_build
from traind.daemon.service import AutotuneInfo, AutotuneSpec, ExperimentSpec, ShuttingDown
from traind.daemon.tasks import KeyedTasks
from traind.trainer.fp8_support import fp8_unsupported_reason, torchao_available

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from sqlalchemy import Engine

    from traind.daemon.experiments.service import Experiments
    from traind.daemon.runs.supervisor import Supervisor

    Promote = Callable[..., Awaitable[int | None]]

log = logging.getLogger("traind")


def hardware(settings: Settings, spec: AutotuneSpec) -> Hardware:
    """What this node can run (the job as the spec's overrides change it)."""
    job = {**settings.job.model_dump(), **{k.split(".", 1)[1]: v for k, v in
                                            spec.overrides.items() if k.startswith("job.")}}
    strategy = spec.overrides.get("parallel.strategy", settings.parallel.strategy)
    tp = int(spec.overrides.get("parallel.tp", settings.parallel.tp))
    pp = int(spec.overrides.get("parallel.pp", settings.parallel.pp))
    ranks = int(job["nproc_per_node"]) * int(job["nnodes"])
    devices = read_devices()  # NVML: the daemon never initialises CUDA
    cuda, capability = devices.count > 0, devices.capability
    # the trainer's rule (one home): a GPU with fp8 tensor cores, or torchao's CPU emulation
    fp8 = fp8_unsupported_reason(cuda, capability, torchao_available()) is None
    return Hardware(device="cuda" if cuda else "cpu", ranks=ranks, strategy=str(strategy),
                    fp8=fp8, bf16=True, tp=tp, pp=pp)


def round_spec(spec: AutotuneSpec, tune_id: int, rnd: Round) -> ExperimentSpec:
    """The A/B experiment of one round: the best so far first (the baseline), then the
    challengers. Quality rounds, and the stages whose setting a running job cannot change,
    run forked (``Round.forked``).

    A mesh all the arms share (the mesh stage's winner, carried) is the job's: it goes into
    the overrides, so an interleaved job runs on it. Arms of different meshes (the mesh
    stage) are forked jobs each; their common starting checkpoint is then written sharded
    (``parallel.sharded_checkpoints``): torch.distributed.checkpoint reshards on load, where a
    single-file checkpoint resumes on the mesh that wrote it only."""
    quality = rnd.phase == "quality"
    arms = [rnd.baseline.arm(), *(c.arm() for c in rnd.challengers)]
    overrides = dict(spec.overrides)
    tables = {json.dumps(a.get("mesh"), sort_keys=True) for a in arms}
    if len(tables) == 1:
        for a in arms:
            overrides.update(a.pop("mesh", None) or {})
    else:
        assert rnd.forked, f"an interleaved round of different meshes: {rnd}"
        overrides["parallel.sharded_checkpoints"] = True
    return ExperimentSpec(
        # A job name too: letters, digits, "_", "." and "-" only.
        name=re.sub(r"[^A-Za-z0-9_.-]+", "-",
                    f"autotune-{tune_id}-{spec.name}-{rnd.stage}"
                    f"{'-quality' if quality else ''}-r{rnd.index + 1}")[:128],
        arms=tuple(arms), steps=rnd.steps,
        block_steps=spec.block_steps, warmup_steps=spec.warmup_steps,
        loss_margin=spec.loss_margin, min_effect=spec.min_effect,
        equivalence=spec.equivalence, overrides=overrides,
        mode="forked" if rnd.forked else "interleaved",
        repeats=spec.quality_repeats if quality else spec.repeats, reuse=rnd.reuse,
        carry=rnd.carry)


def plan_search(settings: Settings, spec: AutotuneSpec) -> tuple[Plan, list[tuple[str, str]]]:
    """The first plan and what is left out (a candidate's name, or ``mesh`` for the whole mesh
    stage, and why), every arm checked as its experiment would check it: ``ConfigError``
    names the field before anything is recorded."""
    if not spec.precisions:
        raise ConfigError.at(("precisions",), "give at least one")
    if not spec.compressions:
        raise ConfigError.at(("compressions",), "give at least one (\"none\" is always included)")
    for i, table in enumerate(spec.compressions):
        if not isinstance(table, Mapping) or not isinstance(table.get("method", "none"), str):
            raise ConfigError.at(("compressions", i), "must be a table with a method")
    hw = hardware(settings, spec)
    shapes: list[dict[str, Any]] = []
    refused: list[tuple[str, str]] = []
    if spec.mesh:  # the job's other shapes, by the mesh rules (daemon/autotune/mesh.py)
        job = job_config(settings, spec.overrides)
        if (why := meshes.skipped(meshes.world_size(job))) is not None:
            refused.append(("mesh", f"stage skipped: {why}"))
        else:
            shapes, out = meshes.settings(job)
            refused += [(Candidate(settings.precision.mode, {"method": "none"}, mesh=t).name, r)
                        for t, r in out]
    space = Space(tuple(spec.precisions), tuple(spec.compressions), tuple(spec.bucket_mb),
                  tuple(shapes))
    feasible, out_of_space = autotune.candidates(space, hw)
    left_out = [(c.name, r) for c, r in out_of_space] + refused
    base = Candidate(settings.precision.mode, {"method": "none"})
    if autotune.infeasible(base, hw) is not None:
        raise ConfigError.at(("precision",), f"the job's own {base.precision!r} cannot be the "
                             "tuner's baseline (only fp32 and bf16 switch inside a job)")
    try:
        plan = autotune.start(feasible, base=base, steps=spec.steps,
                              max_rounds=spec.max_rounds,
                              quality_steps=spec.quality_steps or None, hw=hw)
    except ValueError as exc:
        raise ConfigError.of(exc) from None

    def check(rnd: Round) -> None:
        rs = round_spec(spec, 0, rnd)
        (forked_configs if rs.mode == "forked" else experiment_config)(settings, rs)

    for c in feasible:  # each arm as its round's experiment will see it: errors name it
        if c.name == base.name:
            continue
        arm = autotune.runs_on(c, space, hw)  # a compression the job's own mesh refuses
        stage = "mesh" if arm.mesh is not None else \
            "bucket" if c.bucket_mb is not None else "compression"
        probe = Round(stage, 0, base, (arm,), spec.steps)
        try:
            check(probe)
        except ConfigError as exc:
            raise exc.within(c.name) from None
    # then every stage's first rounds, the search's largest (a budget too small for its arms)
    for rnd in autotune.first_rounds(plan):
        try:
            check(rnd)
        except ConfigError as exc:
            raise exc.within(f"the {rnd.stage} stage's first {rnd.phase} round") from None
    return plan, left_out


class AutoTuner:
    """The node's searches: one task each, one round (experiment) at a time."""

    def __init__(self, *, settings: Settings, engine: Engine, runs: Supervisor,
                 experiments: Experiments, promote: Promote) -> None:
        """``promote``: ``Node.promote`` (hands the winner to the target run)."""
        self.settings, self.engine = settings, engine
        self.runs, self.experiments, self._promote = runs, experiments, promote
        self._tasks: KeyedTasks[int] = KeyedTasks("autotune")

    async def submit(self, spec: AutotuneSpec) -> AutotuneInfo:
        plan, left_out = plan_search(self.settings, spec)  # ConfigError: nothing stored
        if spec.target_run_id is not None and not self.runs.running(spec.target_run_id):
            raise ConfigError.at(("target_run_id",), f"run {spec.target_run_id} is not "
                                 "running on this node")
        tune_id = await asyncio.to_thread(self._create, spec, plan, left_out)
        self.start(tune_id)
        found = await asyncio.to_thread(self.get, tune_id)
        assert found is not None
        return found

    def start(self, tune_id: int) -> None:
        self._tasks.start(tune_id, lambda: self._drive(tune_id))

    async def wait(self, tune_id: int) -> None:
        await self._tasks.wait(tune_id)

    async def cancel(self, tune_id: int) -> bool:
        found = await asyncio.to_thread(self.get, tune_id)
        if found is None or found.state != "running":
            return False
        await asyncio.to_thread(db.end_autotune, self.engine, tune_id=tune_id,
                                state="cancelled")
        self._tasks.cancel(tune_id)
        for r in found.rounds:
            if r.get("verdicts") is None and r.get("experiment_id") is not None:
                await self.experiments.cancel_experiment(r["experiment_id"])
        return True

    async def close(self) -> None:
        await self._tasks.close()

    def unfinished(self) -> list[int]:
        return db.running_autotunes(self.engine)

    # -- the search -----------------------------------------------------------------------

    async def _drive(self, tune_id: int) -> None:
        try:
            while True:
                found = await asyncio.to_thread(db.progress, self.engine, tune_id=tune_id)
                if found is None or found.state != "running":
                    return
                spec = AutotuneSpec(**found.submitted)
                plan = Plan.from_dict(found.plan)
                if found.current is None:
                    plan, rnd = autotune.next_round(plan)
                    if rnd is None:
                        await self._finish(tune_id, spec, plan)
                        return
                    info = await self.experiments.submit_experiment(round_spec(spec, tune_id, rnd))
                    rnd = dataclasses.replace(rnd, experiment_id=info.id)
                    await asyncio.to_thread(self._save, tune_id, plan, rnd)
                else:
                    rnd = Round.from_dict(found.current)
                verdicts = await self._verdicts(rnd)
                # An interleaved round stopped with its daemon resumes in its run at the
                # next start (experiments/interleaved.py), so this waits on. One that a daemon
                # before that ended failed and interrupted (still in older databases) showed
                # nothing: it runs again.
                if interrupted(verdicts):
                    await self._again(tune_id, spec, plan, rnd)
                    continue
                plan = autotune.record(plan, rnd, verdicts)
                await asyncio.to_thread(self._save, tune_id, plan, None)
        except asyncio.CancelledError:
            raise
        except ShuttingDown:  # still running in the database: the next start carries on
            log.info("autotune %d carries on at the next start", tune_id)
        except Exception as exc:  # recorded, not lost in a task nobody awaits
            log.exception("autotune %d failed", tune_id)
            await asyncio.to_thread(db.end_autotune, self.engine, tune_id=tune_id,
                                    state="failed", error=str(exc))

    async def _again(self, tune_id: int, spec: AutotuneSpec, plan: Plan, rnd: Round) -> None:
        """Run an interrupted round again as a new experiment, which goes on from the pairs
        the interrupted one measured (``carry``, as a stage's later rounds do). Its verdicts
        are never recorded: an untested challenger is neither failed nor a winner."""
        assert rnd.experiment_id is not None
        log.info("autotune %d: the %s %s round's experiment %d was interrupted by a daemon "
                 "stop; it runs again", tune_id, rnd.stage, rnd.phase, rnd.experiment_id)
        again = dataclasses.replace(rnd, experiment_id=None, verdicts=None, carry=(
            (*rnd.carry, rnd.experiment_id) if not rnd.forked else rnd.carry))
        info = await self.experiments.submit_experiment(round_spec(spec, tune_id, again))
        await asyncio.to_thread(self._save, tune_id, plan,
                                dataclasses.replace(again, experiment_id=info.id))

    async def _verdicts(self, rnd: Round) -> dict[str, Any]:
        """The round's verdicts once its experiment has ended (a lost or failed experiment
        gives none: every challenger then counts as failed)."""
        assert rnd.experiment_id is not None
        info = await self.experiments.wait_ended(rnd.experiment_id)
        verdict = (info.verdict if info is not None else None) or {}
        return {name: v for name, v in verdict.items() if isinstance(v, Mapping)}

    async def _finish(self, tune_id: int, spec: AutotuneSpec, plan: Plan) -> None:
        # The best says when it is the untested baseline (nothing beat it): the pages show it,
        # and the target run is sent nothing (hand_over records why).
        baseline = nothing_beat_baseline(plan)
        restart = autotune.needs_restart(plan.best)  # a mesh winner: no running job takes it
        await asyncio.to_thread(db.end_autotune, self.engine, tune_id=tune_id, state="done",
                                best={**plan.best.as_dict(), "nothing_beat_baseline": baseline,
                                      **({"needs_restart": restart} if restart else {})},
                                plan=plan.as_dict())
        if spec.target_run_id is not None and restart is not None:
            log.info("autotune %d: not promoted into run %d: %s", tune_id, spec.target_run_id,
                     restart)
        elif spec.target_run_id is not None:
            # What a running job can switch: precision and compression. Its bucket size is
            # built once: a winner's is in the search's best, for the job's next start.
            evidence = {"autotune_id": tune_id, "rounds": [r.as_dict() for r in plan.rounds]}
            try:
                await self._promote(spec.target_run_id, {
                    "precision": plan.best.precision,
                    "compression": dict(plan.best.compression)},
                    evidence=evidence, autotune_id=tune_id, baseline=baseline,
                    experiment_ids=[r.experiment_id for r in plan.rounds
                                    if r.experiment_id is not None])
            except ConfigError as exc:  # evidence from another config: the row says so
                log.warning("autotune %d: not promoted into run %d: %s", tune_id,
                            spec.target_run_id, exc)

    # -- storage (the queries are daemon/db/autotunes.py's) --------------------------------

    def _create(self, spec: AutotuneSpec, plan: Plan,
                left_out: Sequence[tuple[str, str]]) -> int:
        submitted = json.loads(json.dumps(_asdict(spec)))
        return db.create_autotune(
            self.engine, name=spec.name,
            space={"precisions": list(spec.precisions),
                   "compressions": [dict(c) for c in spec.compressions],
                   "bucket_mb": list(spec.bucket_mb), "mesh": spec.mesh},
            submitted=submitted,
            infeasible=[{"candidate": c, "reason": r} for c, r in left_out],
            plan=plan.as_dict(), target_run_id=spec.target_run_id,
            config_hash=config_hash(submitted),
            traind_version=__version__, torch_version=torch_build().version,
            device=read_devices().kind)

    def _save(self, tune_id: int, plan: Plan, current: Round | None) -> None:
        db.save_round(self.engine, tune_id=tune_id, plan=plan.as_dict(),
                      current=None if current is None else current.as_dict(),
                      best=plan.best.as_dict())

    def get(self, tune_id: int) -> AutotuneInfo | None:
        return db.get_autotune(self.engine, tune_id=tune_id)

    def list(self, *, limit: int | None = None, offset: int = 0) -> list[AutotuneInfo]:
        """Searches, newest first (one page with ``limit``)."""
        return db.list_autotunes(self.engine, limit=limit, offset=offset)


def _asdict(spec: AutotuneSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in AutotuneSpec.__dataclass_fields__}
