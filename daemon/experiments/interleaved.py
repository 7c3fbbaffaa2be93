"""Interleaved experiments and the verdicts of interleaved runs, as the node runs them.

Every run whose config has interleaved arms is followed from its launch (the supervisor's
``launching`` hook): its lead rank's ``ArmEvent`` blocks are judged as they arrive (pure math,
microseconds) and the verdict so far is the run's summary's ``ab`` (the runs page shows it).
An interleaved experiment is such a run, started here from the queue: one at a time up to
``daemon.max_experiment_jobs``, linked to its run (``experiments.run_id``), its trials held by
the run for its life. Its verdict's one home is its row: the verdict so far is written there
by the database flush, the final one when the run's ``ended`` future resolves (each trial then
gets its arm's blocks, and the next queued experiment starts). An experiment whose daemon died
under it is ended at the next start (:meth:`InterleavedRunner.end_stranded`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from traind import __version__
from traind.contracts.events import ArmEvent
from traind.daemon.config import ConfigError
from traind.daemon.db import queue
from traind.daemon.devices import read_devices
from traind.daemon.experiments.ab import Block, evaluate
from traind.daemon.experiments.specs import LEASE_SECONDS, experiment_config
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from sqlalchemy import Engine

    from traind.contracts.events import Event
    from traind.daemon.config import Settings
    from traind.daemon.runs.supervisor import RunHandle, Supervisor
    from traind.daemon.service import ExperimentSpec

log = logging.getLogger("traind")
# What an interleaved experiment whose daemon died says (its blocks died with the daemon).
DAEMON_STOPPED = "the daemon stopped while its run was training; submit it again"


@dataclass
class _Blocks:
    """One interleaved run's evidence so far."""

    arms: list[str]
    margin: float
    blocks: list[Block] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)


def judge(state: _Blocks, *, finished: bool) -> dict[str, Any]:
    """The verdict of ``state``'s blocks; a block that cannot be judged says so instead."""
    try:
        return evaluate(state.blocks, state.arms, finished=finished, loss_margin=state.margin)
    except ValueError as exc:  # e.g. a block with no throughput: say so, do not crash
        return {a: {"kind": "failed (error)", "reason": str(exc)} for a in state.arms[1:]}


class InterleavedRunner:
    def __init__(self, *, settings: Settings, engine: Engine, runs: Supervisor,
                 on_end: Callable[[], None] = lambda: None) -> None:
        """``on_end``: called each time one of its experiments has ended."""
        self.settings, self.engine, self.runs = settings, engine, runs
        self._on_end = on_end
        self._ab: dict[int, _Blocks] = {}  # run id -> its blocks and verdict so far
        self._experiments: dict[int, int] = {}  # run id -> experiment id
        self._live: dict[int, dict[str, Any]] = {}  # experiment id -> verdict not yet written
        self._lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[Any]] = set()
        runs.launching.append(self.follow)

    # -- every interleaved run -----------------------------------------------------------------

    def follow(self, handle: RunHandle, cfg: TrainConfig) -> None:
        """The supervisor's launch hook: judge the run's blocks as they arrive, and finish
        once it ended."""
        if not cfg.interleave.arms:
            return
        state = _Blocks([a.name for a in cfg.interleave.arms], cfg.interleave.loss_margin)
        self._ab[handle.id] = state

        def observe(event: Event) -> None:
            if isinstance(event, ArmEvent):
                state.blocks.append(Block(event.arm, event.block, event.tokens,
                                          event.seconds, event.loss, event.grad_error))
                self._set_verdict(handle.id, state, judge(state, finished=False))

        handle.observe(observe)
        task = asyncio.create_task(self._finish(handle, state))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _set_verdict(self, run_id: int, state: _Blocks, verdict: dict[str, Any]) -> None:
        state.verdict = verdict
        if (summary := self.runs.summaries.get(run_id)) is not None:
            summary.ab, summary.dirty = verdict, True
        if (exp_id := self._experiments.get(run_id)) is not None:
            self._live[exp_id] = verdict  # to its row at the next flush

    def flush(self) -> None:
        """Write the experiments' verdicts so far (the node's flush loop, off the event loop;
        never one write per block)."""
        pending, self._live = self._live, {}
        for exp_id, verdict in pending.items():
            try:
                queue.set_live_verdict(self.engine, experiment_id=exp_id, verdict=verdict)
            except BaseException:
                self._live.setdefault(exp_id, verdict)  # at the next flush that gets through
                raise

    def end_stranded(self, node: str) -> list[int]:
        """End every interleaved experiment whose run on ``node`` stopped with a daemon that
        never saw it end (SIGKILL, a power cut): ``failed``, saying why, its trials' leases
        released. Not resumed: its blocks so far were the dead daemon's memory. At start-up,
        before anything runs; returns their ids."""
        ended = []
        for exp_id in queue.stranded_interleaved(self.engine, node=node):
            view = queue.get_experiment(self.engine, experiment_id=exp_id)
            assert view is not None
            verdict = {a["name"]: {"kind": "failed (error)", "reason": DAEMON_STOPPED}
                       for a in view.arms if not a["is_baseline"]}
            if queue.finish_experiment(self.engine, experiment_id=exp_id, verdict=verdict,
                                       state="failed"):
                ended.append(exp_id)
        return ended

    async def _finish(self, handle: RunHandle, state: _Blocks) -> None:
        end = await handle.ended
        run_id = handle.id
        try:
            self._set_verdict(run_id, state, judge(state, finished=end.state == "completed"))
            await asyncio.to_thread(self.runs.flush_summaries)
            if (exp_id := self._experiments.get(run_id)) is not None:
                self._live.pop(exp_id, None)  # the final verdict follows
                await asyncio.to_thread(self._end_experiment, exp_id, state, end.state)
        finally:
            self._ab.pop(run_id, None)
            ended_experiment = self._experiments.pop(run_id, None) is not None
        if ended_experiment:  # its slot is free: the next queued one starts
            self._on_end()
            await self.start_queued()

    def _end_experiment(self, exp_id: int, state: _Blocks, run_state: str) -> None:
        """Each arm's trial gets its blocks, the experiment its verdict (unless it was
        cancelled meanwhile)."""
        for t in queue.list_trials(self.engine, experiment_id=exp_id):
            mine = [b for b in state.blocks if b.arm == t.arm_name]
            queue.complete(self.engine, trial_id=t.id, attempt=t.attempt, result={
                "blocks": len(mine), "tokens": sum(b.tokens for b in mine),
                "seconds": sum(b.seconds for b in mine)})
        queue.finish_experiment(self.engine, experiment_id=exp_id, verdict=state.verdict,
                                state="done" if run_state == "completed" else "failed")

    # -- interleaved experiments ---------------------------------------------------------------

    async def submit(self, spec: ExperimentSpec) -> int:
        """Record an interleaved experiment and start it now, or once a running one ends (it
        stays queued). ``ConfigError`` before anything is written."""
        # Validating a config takes milliseconds, so it runs off the loop too (a burst of
        # submissions would otherwise stall it).
        cfg = await asyncio.to_thread(experiment_config, self.settings, spec)
        await asyncio.to_thread(self.runs.admit, cfg)
        arms = [{"name": a.name, "baseline": i == 0,
                 "overrides": {"compression": a.compression, "precision": a.precision}}
                for i, a in enumerate(cfg.interleave.arms)]
        device = read_devices().kind  # NVML: the daemon never initialises CUDA
        exp_id = await asyncio.to_thread(
            queue.create_experiment, self.engine, name=spec.name, mode="interleaved",
            base_config=cfg.model_dump(mode="json"), arms=arms,
            budget={"steps": spec.steps, "block_steps": spec.block_steps},
            traind_version=__version__, torch_version=torch.__version__, device=device)
        await self.start_queued()
        return exp_id

    async def start_queued(self) -> None:
        """Start queued interleaved experiments, oldest first, while fewer than
        ``daemon.max_experiment_jobs`` run (each is a job of its own: at once they would
        share the node's cores and measure each other)."""
        async with self._lock:
            while (len(self._experiments) < self.settings.daemon.max_experiment_jobs
                   and not self.runs.stopping):
                started = set(self._experiments.values())
                waiting = [i for i in await asyncio.to_thread(
                    queue.experiment_ids, self.engine, mode="interleaved", states=("queued",))
                    if i not in started]
                if not waiting:
                    return
                await self._start_one(waiting[0])

    async def _start_one(self, exp_id: int) -> None:
        view = await asyncio.to_thread(queue.get_experiment, self.engine,
                                       experiment_id=exp_id)
        assert view is not None
        try:
            handle = await self.runs.submit(TrainConfig.model_validate(view.base_config))
        except ConfigError as exc:  # the node changed since it was admitted: say why
            log.error("interleaved experiment %d cannot start: %s", exp_id, exc)
            await asyncio.to_thread(queue.cancel_experiment, self.engine,
                                    experiment_id=exp_id)
            self._on_end()
            return
        await asyncio.to_thread(queue.link_run, self.engine, experiment_id=exp_id,
                                run_id=handle.id)
        for _ in view.arms:  # the job holds every arm's trial for its life
            await asyncio.to_thread(queue.claim, self.engine, owner=f"run:{handle.id}",
                                    lease_seconds=LEASE_SECONDS, experiment_id=exp_id)
        self._experiments[handle.id] = exp_id
