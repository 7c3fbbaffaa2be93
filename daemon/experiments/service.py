"""Experiments as the node serves them: submit, list, read and cancel, whatever their mode.

Interleaved ones go to the interleaved runner, forked ones to the forked runner; both store
their experiment in the queue tables, and a view of one is read from there (its live verdict,
while its run trains, from the interleaved runner).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from traind import __version__
from traind.contracts.states import EXPERIMENT_ACTIVE, EXPERIMENT_ENDED
from traind.daemon.db import crud, queue
from traind.daemon.devices import read_devices
from traind.daemon.experiments import bands, evidence
from traind.daemon.experiments.forked import MIN_BASE_STEPS
from traind.daemon.experiments.reuse import reusable
from traind.daemon.experiments.specs import (
    forked_configs,
    info,
    starting_checkpoint,
)
from traind.daemon.provenance import torch_build
from traind.daemon.service import PAGE, ShuttingDown

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from traind.daemon.config import Settings
    from traind.daemon.experiments.forked import ForkedRunner
    from traind.daemon.experiments.interleaved import InterleavedRunner
    from traind.daemon.runs.supervisor import Supervisor
    from traind.daemon.service import ExperimentEvidence, ExperimentInfo, ExperimentSpec


class Ends:
    """Wakes whoever waits for an experiment to end: ``notify`` each time one may have
    ended (the runners call it), and each waiter reads its own experiment's state again."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def next(self) -> asyncio.Event:
        """The event the next ``notify`` sets (take it before reading the state)."""
        return self._event


class Experiments:
    def __init__(self, *, settings: Settings, engine: Engine, runs: Supervisor,
                 interleaved: InterleavedRunner, forked: ForkedRunner, ends: Ends) -> None:
        self.settings, self.engine, self.runs = settings, engine, runs
        self.interleaved, self.forked, self.ends = interleaved, forked, ends

    async def wait_ended(self, experiment_id: int) -> ExperimentInfo | None:
        """The experiment once it has ended (None if it is gone), woken by its runner."""
        while True:
            woken = self.ends.next()
            found = await asyncio.to_thread(self.experiment, experiment_id)
            if found is None or found.state in EXPERIMENT_ENDED:
                return found
            await woken.wait()

    async def submit_experiment(self, spec: ExperimentSpec) -> ExperimentInfo:
        if self.runs.stopping:
            raise ShuttingDown("the daemon is shutting down: submit again once it is back")
        # the band left to the node: from this node's noise, before any data of its own
        recent = await asyncio.to_thread(self.experiments, limit=PAGE)
        spec, band = bands.resolve(spec, recent)
        if spec.mode != "interleaved":
            exp_id = await self._submit_forked(spec, band)
        else:
            exp_id = await self.interleaved.submit(spec, band)
        found = await asyncio.to_thread(self.experiment, exp_id)  # a read: off the loop
        assert found is not None
        return found

    async def _submit_forked(self, spec: ExperimentSpec, band: dict[str, Any] | None) -> int:
        """Record a forked experiment (its trials queue in ABBA order) and start its runner.
        Every arm's job config is checked first: nothing is recorded for a bad one."""
        known = spec.checkpoint_run is not None and await asyncio.to_thread(
            crud.get_run, self.engine, run_id=spec.checkpoint_run) is not None
        # ConfigError names the field; the checkpoint is resolved from ids under var_dir.
        base, _ = await asyncio.to_thread(forked_configs, self.settings, spec, run_known=known)
        # The arms change compression, precision, bucket size and mesh only: what admission
        # looks at (device, ranks, threads, model and batch) is the base's. A mesh arm's batch
        # per rank differs, but its global batch is the base's (daemon/autotune/mesh.py).
        await asyncio.to_thread(self.runs.admit, base)
        start = starting_checkpoint(self.settings, spec, run_known=known)
        arms = [{"name": a.get("name"), "baseline": i == 0,
                 "overrides": {"compression": dict(a.get("compression") or {}),
                               "precision": a.get("precision"),
                               **({"bucket_mb": a["bucket_mb"]} if a.get("bucket_mb") else {}),
                               **({"mesh": dict(a["mesh"])} if a.get("mesh") else {})}}
                for i, a in enumerate(spec.arms)]
        base_config = base.model_dump(mode="json")
        done: dict[tuple[int, int], dict[str, Any]] = {}
        if start is None and spec.reuse:
            start, done = await asyncio.to_thread(
                reusable, self.engine, spec.reuse, base_config=base_config,
                arms=arms, repeats=spec.repeats,
                experiments_dir=self.settings.daemon.var_dir / "experiments")
        checkpoint = str(start) if start is not None else None
        budget = {"steps": spec.steps, "repeats": spec.repeats, "loss_margin": spec.loss_margin,
                  # Where the forked verdict (forked.py _finish) reads its settings from.
                  "min_effect": spec.min_effect, "equivalence": spec.equivalence,
                  "equivalence_auto": band,
                  # No checkpoint given: a base job of this many steps makes one, and each
                  # trial's result names it.
                  "checkpoint": checkpoint,
                  "base_steps": None if checkpoint else max(MIN_BASE_STEPS, spec.block_steps),
                  "reused_trials": len(done)}
        device = read_devices().kind  # NVML: the daemon never initialises CUDA
        exp_id = await asyncio.to_thread(
            queue.create_experiment, self.engine, name=spec.name, mode="forked",
            base_config=base_config, arms=arms, budget=budget,
            repeats=spec.repeats, traind_version=__version__, torch_version=torch_build().version,
            device=device, done=done)
        self.forked.start(exp_id)
        return exp_id

    def unfinished_forked(self) -> list[int]:
        return queue.experiment_ids(self.engine, mode="forked", states=EXPERIMENT_ACTIVE)

    def experiments(self, *, limit: int = PAGE, offset: int = 0) -> list[ExperimentInfo]:
        return [self._info(v) for v in
                queue.list_experiments(self.engine, limit=limit, offset=offset)]

    def experiment(self, experiment_id: int) -> ExperimentInfo | None:
        view = queue.get_experiment(self.engine, experiment_id=experiment_id)
        return self._info(view) if view else None

    def experiment_evidence(self, experiment_id: int) -> ExperimentEvidence | None:
        view = queue.get_experiment(self.engine, experiment_id=experiment_id)
        if view is None:
            return None
        arms = [a["name"] for a in view.arms]
        if view.mode == "forked":
            ms = evidence.trials_of(queue.list_trials(self.engine, experiment_id=experiment_id))
        elif view.run_id is not None:
            ms = evidence.blocks_of(crud.run_events(self.engine, run_id=view.run_id,
                                                    kind="arm"))
        else:
            ms = []
        return evidence.summarise(mode=view.mode, arms=arms, budget=view.budget,
                                  measurements=ms, verdict=view.verdict)

    async def cancel_experiment(self, experiment_id: int) -> bool:
        """Cancelled in the database at once (the pages say so from then on); its job is
        asked to checkpoint and exit at its next step boundary, not waited for: a web
        request must not hang on a job's exit (up to the stop's grace of 30 s)."""
        found = await asyncio.to_thread(self.experiment, experiment_id)
        if found is None or found.state not in EXPERIMENT_ACTIVE:
            return False
        await asyncio.to_thread(queue.cancel_experiment, self.engine,
                                experiment_id=experiment_id)
        if found.run_id is not None:
            self.runs.request_stop(found.run_id)
        self.forked.cancel(experiment_id)  # a forked one's current job (or base job)
        self.ends.notify()
        return True

    def _info(self, view: queue.ExperimentView) -> ExperimentInfo:
        return info(view)
