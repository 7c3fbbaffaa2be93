"""Interleaved experiments and the verdicts of interleaved runs, as the node runs them.

Every run whose config has interleaved arms is followed from its launch (the supervisor's
``launching`` hook): its lead rank's ``ArmEvent`` blocks are judged as they arrive (pure math,
microseconds) and the verdict so far is the run's summary's ``ab`` (the runs page shows it).
An interleaved experiment is such a run, started here from the queue once it holds one of the
node's experiment slots (``experiments/slots.py``, shared with forked experiments' jobs: one
experiment job at a time by default), linked to its run (``experiments.run_id``), its trials
held by the run for its life. Its verdict's one home is its row: the verdict so far is written
there by the database flush, the final one when the run's ``ended`` future resolves (each
trial then gets its arm's blocks, the slot is freed and the oldest waiting experiment starts).

An arm is decided the first time its verdict leaves ``running`` (the sequential test stopped,
or the run ended); its verdict is kept as it was then, with the step (``decided_at_step``) and
the budget (``budget_steps``). Once every arm of an experiment is decided its run is stopped at
once and the experiment ends ``done`` with that verdict: the time to a decision is the
decision's, not the budget's. An experiment whose daemon stopped under it (SIGTERM, or a
SIGKILL whose ranks saved as they left) resumes at the next start from its job's checkpoint,
with the blocks its run stored (:meth:`InterleavedRunner.resume_preempted`); one whose job
never saved a checkpoint is queued again (:meth:`InterleavedRunner.requeue_stranded`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traind import __version__
from traind.contracts.events import ArmEvent
from traind.daemon.config import ConfigError
from traind.daemon.db import crud, queue
from traind.daemon.devices import read_devices
from traind.daemon.experiments.ab import INTERRUPTED, Block, evaluate
from traind.daemon.experiments.reuse import carried_of, carried_pairs
from traind.daemon.experiments.specs import LEASE_SECONDS, experiment_config
from traind.daemon.provenance import torch_build
from traind.daemon.runs.supervisor import RunHandle
from traind.daemon.service import ShuttingDown
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from sqlalchemy import Engine

    from traind.contracts.events import Event
    from traind.daemon.config import Settings
    from traind.daemon.experiments.slots import Slots
    from traind.daemon.runs.supervisor import Supervisor
    from traind.daemon.service import ExperimentSpec

log = logging.getLogger("traind")


RUNNING = "running"
FAILED = "failed (error)"
FAILED_RUN = "failed"  # the run ended (stopped, failed, preempted) before an arm was decided


@dataclass
class _Blocks:
    """One interleaved run's evidence so far."""

    arms: list[str]
    margin: float  # nats
    budget_steps: int
    min_effect: float = 0.02
    equivalence: float = 0.02
    blocks: list[Block] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)
    step: int = 0  # the last block's step
    decided: bool = False  # every arm decided: the verdict is final, the run is stopping
    # per arm: the log ratios of pairs earlier experiments measured of the same comparison,
    # which its verdict goes on from (ExperimentSpec.carry, daemon/experiments/reuse.py)
    prior: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Resumed:
    """A preempted experiment's evidence, read back for its resumed run."""

    blocks: list[Block]
    step: int
    verdict: dict[str, Any]
    prior: dict[str, list[float]]


def stored_blocks(rows: list[dict[str, Any]]) -> tuple[list[Block], int]:
    """A run's stored ``arm`` rows (daemon/ingest/messages.row) as blocks, and the last
    one's step."""
    blocks = [Block(r["data"]["arm"], r["data"]["block"], r["data"]["tokens"],
                    r["data"]["seconds"], r["data"]["loss"], r["data"]["grad_error"])
              for r in rows]
    return blocks, max((r["step"] for r in rows), default=0)


def judge(state: _Blocks, *, finished: bool) -> dict[str, Any]:
    """The verdict of ``state``'s blocks; a block that cannot be judged says so instead."""
    try:
        return evaluate(state.blocks, state.arms, finished=finished, loss_margin=state.margin,
                        min_effect=state.min_effect, equivalence=state.equivalence,
                        prior=state.prior)
    except ValueError as exc:  # e.g. a block with no throughput: say so, do not crash
        return {a: {"kind": FAILED, "reason": str(exc)} for a in state.arms[1:]}


def settle(before: dict[str, Any], now: dict[str, Any], *, step: int, budget_steps: int,
           finished: bool = False) -> dict[str, Any]:
    """The verdict to show: an arm decided before keeps its verdict of then (the always-valid
    test may stop at its first crossing, and what it said there is the result); an arm
    decided now gets the step and the budget beside it. ``finished``: the run ended by
    itself, so an arm still ``running`` (too few pairs) is ``inconclusive (budget spent)``:
    an ended experiment never shows a running verdict."""
    out: dict[str, Any] = {}
    for arm, record in now.items():
        kept = before.get(arm)
        if kept is not None and kept.get("kind") != RUNNING:
            out[arm] = kept
            continue
        record = {**record, "budget_steps": budget_steps}
        if finished and record.get("kind") == RUNNING:
            record = {**record, "kind": "inconclusive (budget spent)",
                      "reason": f"the budget ended before a verdict: "
                                f"{record.get('reason', 'too few pairs')}"}
        if record.get("kind") != RUNNING:
            record["decided_at_step"] = step
        out[arm] = record
    return out


def undecided_as(verdict: dict[str, Any], kind: str, why: str) -> dict[str, Any]:
    """``verdict`` with each arm still ``running`` ended as ``kind`` (cancelled, failed):
    its last "1.26x so far" is no verdict, and must not read as one still coming."""
    out = {}
    for arm, record in verdict.items():
        if record.get("kind") == RUNNING:
            last = record.get("reason")
            record = {**record, "kind": kind,
                      "reason": f"{why} before {arm} was decided"
                                + (f"; when it stopped: {last}" if last else "")}
        out[arm] = record
    return out


def decided(verdict: dict[str, Any]) -> bool:
    """Whether every arm of ``verdict`` has its final kind."""
    return bool(verdict) and all(v.get("kind") != RUNNING for v in verdict.values())


def final_state(verdict: dict[str, Any]) -> str:
    """The state of an experiment ended with ``verdict``."""
    return "failed" if any(v.get("kind") == FAILED for v in verdict.values()) else "done"


class InterleavedRunner:
    def __init__(self, *, settings: Settings, engine: Engine, runs: Supervisor, slots: Slots,
                 on_end: Callable[[], None] = lambda: None) -> None:
        """``slots``: the node's experiment slots (each experiment's job holds one for its
        life); ``on_end``: called each time one of its experiments has ended."""
        self.settings, self.engine, self.runs, self.slots = settings, engine, runs, slots
        self._on_end = on_end
        self._ab: dict[int, _Blocks] = {}  # run id -> its blocks and verdict so far
        self._experiments: dict[int, int] = {}  # run id -> experiment id
        # run id -> set once its experiment's trials are claimed (its end waits for that)
        self._linked: dict[int, asyncio.Event] = {}
        self._live: dict[int, dict[str, Any]] = {}  # experiment id -> verdict not yet written
        self._lock = asyncio.Lock()
        self._pending: set[int] = set()  # experiments waiting for a slot, or starting
        self._resuming: dict[int, _Resumed] = {}  # run id -> its evidence, until it launches
        self.tasks: set[asyncio.Task[Any]] = set()  # following runs, stopping decided ones
        self._waiters: set[asyncio.Task[Any]] = set()  # experiments waiting for a slot
        runs.launching.append(self.follow)

    # -- every interleaved run -----------------------------------------------------------------

    def follow(self, handle: RunHandle, cfg: TrainConfig) -> None:
        """The supervisor's launch hook: judge the run's blocks as they arrive, stop an
        experiment's run once every arm is decided, and finish once it ended."""
        if not cfg.interleave.arms:
            return
        il = cfg.interleave
        state = _Blocks([a.name for a in il.arms], il.loss_margin, cfg.job.steps,
                        min_effect=il.min_effect, equivalence=il.equivalence)
        if (resumed := self._resuming.pop(handle.id, None)) is not None:
            state.blocks, state.step = list(resumed.blocks), resumed.step
            state.verdict, state.prior = resumed.verdict, resumed.prior
        self._ab[handle.id] = state

        def observe(event: Event) -> None:
            # Once decided, the verdict is the one of that moment: a block that ends while
            # the run stops is not part of it.
            if not isinstance(event, ArmEvent) or state.decided:
                return
            state.blocks.append(Block(event.arm, event.block, event.tokens,
                                      event.seconds, event.loss, event.grad_error))
            state.step = max(state.step, event.step)
            verdict = settle(state.verdict, judge(state, finished=False), step=state.step,
                             budget_steps=state.budget_steps)
            self._set_verdict(handle.id, state, verdict)
            if handle.id in self._experiments and decided(verdict):
                state.decided = True
                self._spawn(self.runs.stop(handle.id))

        handle.observe(observe)
        self._spawn(self._finish(handle, state))

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
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

    def requeue_stranded(self, node: str) -> list[int]:
        """Queue again every interleaved experiment whose run on ``node`` stopped with a
        daemon that never saw it end (SIGKILL, a power cut) before it saved a checkpoint:
        nothing to resume from, so it starts over. At start-up, before anything runs;
        returns their ids."""
        return [exp_id for exp_id in queue.stranded_interleaved(self.engine, node=node)
                if queue.requeue(self.engine, experiment_id=exp_id)]

    async def _finish(self, handle: RunHandle, state: _Blocks) -> None:
        end = await handle.ended
        run_id = handle.id
        if (linked := self._linked.get(run_id)) is not None:
            await linked.wait()  # a run that ended at once: its trials are claimed first
        exp_id = self._experiments.get(run_id)
        exp_state: str | None
        try:
            cancelled = exp_id is not None and await asyncio.to_thread(self._cancelled, exp_id)
            if state.decided:  # stopped by us: the verdict stands as it was decided
                exp_state = final_state(state.verdict)
            elif end.state == "completed":  # its budget ran out
                self._set_verdict(run_id, state, settle(
                    state.verdict, judge(state, finished=True), step=state.step,
                    budget_steps=state.budget_steps, finished=True))
                exp_state = final_state(state.verdict)
            elif end.state == "preempted" and exp_id is not None and not cancelled:
                # The daemon stopped: the run resumes at the next start, and the experiment
                # with it, from the blocks stored with the run's events.
                log.info("interleaved experiment %d resumes at the next start (%d blocks "
                         "so far)", exp_id, len(state.blocks))
                exp_state = None
            else:  # stopped, failed or preempted before a decision
                so_far = settle(state.verdict, judge(state, finished=False), step=state.step,
                                budget_steps=state.budget_steps)
                ended = undecided_as(so_far, "cancelled" if cancelled else FAILED_RUN,
                                     "the experiment was cancelled" if cancelled
                                     else f"the run ended {end.state}")
                if end.state == "preempted" and not cancelled:  # the daemon stopped it
                    ended = {arm: {**r, INTERRUPTED: True} if r.get("kind") == FAILED_RUN
                             else r for arm, r in ended.items()}
                self._set_verdict(run_id, state, ended)
                exp_state = "failed"
            await asyncio.to_thread(self.runs.flush_summaries)
            if exp_id is not None and exp_state is None:  # its verdict so far, on its row
                self._live.pop(exp_id, None)
                await asyncio.to_thread(queue.set_live_verdict, self.engine,
                                        experiment_id=exp_id, verdict=state.verdict)
            elif exp_id is not None and exp_state is not None:
                self._live.pop(exp_id, None)  # the final verdict follows
                await asyncio.to_thread(self._end_experiment, exp_id, state, exp_state)
        finally:
            self._ab.pop(run_id, None)
            self._linked.pop(run_id, None)
            if self._experiments.pop(run_id, None) is not None:
                self.slots.release()  # its slot is free: the oldest waiter starts
        if exp_id is not None and exp_state is not None:
            self._on_end()
            await self.start_queued()

    def _cancelled(self, exp_id: int) -> bool:
        view = queue.get_experiment(self.engine, experiment_id=exp_id)
        return view is not None and view.state == "cancelled"

    def _end_experiment(self, exp_id: int, state: _Blocks, exp_state: str) -> None:
        """Each arm's trial gets its blocks, the experiment its verdict (unless it was
        cancelled meanwhile)."""
        for t in queue.list_trials(self.engine, experiment_id=exp_id):
            mine = [b for b in state.blocks if b.arm == t.arm_name]
            queue.complete(self.engine, trial_id=t.id, attempt=t.attempt, result={
                "blocks": len(mine), "tokens": sum(b.tokens for b in mine),
                "seconds": sum(b.seconds for b in mine)})
        queue.finish_experiment(self.engine, experiment_id=exp_id, verdict=state.verdict,
                                state=exp_state)

    # -- interleaved experiments ---------------------------------------------------------------

    async def submit(self, spec: ExperimentSpec, band: dict[str, Any] | None = None) -> int:
        """Record an interleaved experiment and start it now, or once it holds a slot (it
        stays queued). ``band``: how the node chose its equivalence band (None: the user's),
        stored with it. ``ConfigError`` before anything is written."""
        # Validating a config takes milliseconds, so it runs off the loop too (a burst of
        # submissions would otherwise stall it).
        cfg = await asyncio.to_thread(experiment_config, self.settings, spec)
        await asyncio.to_thread(self.runs.admit, cfg)
        arms = [{"name": a.name, "baseline": i == 0,
                 "overrides": {"compression": a.compression, "precision": a.precision}}
                for i, a in enumerate(cfg.interleave.arms)]
        base_config = cfg.model_dump(mode="json")
        carried, sources = ({}, []) if not spec.carry else await asyncio.to_thread(
            carried_pairs, self.engine, spec.carry, base_config=base_config, arms=arms)
        device = read_devices().kind  # NVML: the daemon never initialises CUDA
        exp_id = await asyncio.to_thread(
            queue.create_experiment, self.engine, name=spec.name, mode="interleaved",
            base_config=base_config, arms=arms,
            budget={"steps": spec.steps, "block_steps": spec.block_steps,
                    "equivalence_auto": band,
                    # the pairs its verdicts go on from, and whose they were
                    "carried": {"from": sources, "pairs": carried}},
            traind_version=__version__, torch_version=torch_build().version, device=device)
        await self.start_queued()
        return exp_id

    async def start_queued(self) -> None:
        """Queued interleaved experiments, oldest first: each starts now if a slot is free,
        else waits for one (the node's ``daemon.max_experiment_jobs``, shared with forked
        experiments' jobs: at once they would share the node's cores and measure each
        other)."""
        async with self._lock:
            if self.runs.stopping:
                return
            started = set(self._experiments.values()) | self._pending
            for exp_id in await asyncio.to_thread(
                    queue.experiment_ids, self.engine, mode="interleaved", states=("queued",)):
                if exp_id in started:
                    continue
                self._pending.add(exp_id)

                async def start(exp_id: int = exp_id) -> None:
                    await self._start_one(exp_id)

                try:
                    await self._start_or_wait(exp_id, start)
                except ShuttingDown:
                    return

    async def resume_preempted(self) -> list[int]:
        """At start: every interleaved experiment whose run the last daemon preempted
        resumes in that run, from its checkpoint, with the blocks it stored (now, or once it
        holds a slot). A preempted experiment run whose experiment ended meanwhile (it was
        cancelled) is stopped. Returns the experiments' ids."""
        node = self.runs.node_name
        found = await asyncio.to_thread(queue.preempted_interleaved, self.engine, node=node)
        mine = {run_id for _, run_id, _, _ in found}
        for run_id, _, _ in await asyncio.to_thread(
                crud.preempted_runs, self.engine, node=node, kind="experiment"):
            if run_id not in mine:
                await asyncio.to_thread(
                    crud.mark_finished, self.engine, run_id=run_id, state="stopped",
                    exit_code=None, error="its experiment ended while it was preempted")
        for exp_id, run_id, config, out_dir in found:
            self._pending.add(exp_id)

            async def resume(exp_id: int = exp_id, run_id: int = run_id,
                             config: dict[str, Any] = config, out_dir: str = out_dir) -> None:
                await self._resume_one(exp_id, run_id, config, out_dir)

            await self._start_or_wait(exp_id, resume)
        return [exp_id for exp_id, _, _, _ in found]

    async def _start_or_wait(self, exp_id: int, start: Callable[[], Awaitable[None]]) -> None:
        """``start()`` now if a slot is free, else once one is (``exp_id`` is pending)."""
        try:
            free = self.slots.try_acquire()
        except ShuttingDown:
            self._pending.discard(exp_id)
            raise
        if free:
            try:
                await start()
            finally:
                self._pending.discard(exp_id)
        else:
            waiter = asyncio.create_task(self._wait_for_slot(exp_id, start))
            self._waiters.add(waiter)
            waiter.add_done_callback(self._waiters.discard)

    async def _resume_one(self, exp_id: int, run_id: int, config: dict[str, Any],
                          out_dir: str) -> None:
        """Resume a preempted experiment's run; the caller took a slot for it, which the run
        holds until its end (or which is given back here if nothing starts)."""
        try:
            view = await asyncio.to_thread(queue.get_experiment, self.engine,
                                           experiment_id=exp_id)
            if view is None or view.state != "running" or self.runs.stopping:
                self.slots.release()
                return
            rows = await asyncio.to_thread(crud.run_events, self.engine, run_id=run_id,
                                           kind="arm")
            blocks, step = stored_blocks(rows)
            self._resuming[run_id] = _Resumed(blocks, step, dict(view.verdict or {}),
                                              carried_of(view.budget))
            self._experiments[run_id] = exp_id
            linked = self._linked[run_id] = asyncio.Event()
            linked.set()  # its trials are held by its run since its first start
            log.info("interleaved experiment %d resumes in run %d with its %d blocks",
                     exp_id, run_id, len(blocks))
            await self.runs.resume(RunHandle(run_id), config, out_dir)
        except BaseException:
            self._resuming.pop(run_id, None)
            if run_id not in self._ab:  # never followed: no _finish will give the slot back
                self._linked.pop(run_id, None)
                self._experiments.pop(run_id, None)
                self.slots.release()
            raise

    async def _wait_for_slot(self, exp_id: int, start: Callable[[], Awaitable[None]]) -> None:
        try:
            await self.slots.acquire(exp_id)
            await start()
        except ShuttingDown:  # it stays queued for the next start
            log.info("interleaved experiment %d waits for the next start", exp_id)
        finally:
            self._pending.discard(exp_id)

    async def _start_one(self, exp_id: int) -> None:
        """Start a queued experiment's run; the caller took a slot for it, which the run
        holds until its end (or which is given back here if nothing starts)."""
        try:
            view = await asyncio.to_thread(queue.get_experiment, self.engine,
                                           experiment_id=exp_id)
            if view is None or view.state != "queued" or self.runs.stopping:
                self.slots.release()  # cancelled while it waited, or the node stops
                return
            handle = await self.runs.submit(TrainConfig.model_validate(view.base_config))
        except ConfigError as exc:  # the node changed since it was admitted: say why
            log.error("interleaved experiment %d cannot start: %s", exp_id, exc)
            self.slots.release()
            await asyncio.to_thread(queue.cancel_experiment, self.engine,
                                    experiment_id=exp_id)
            self._on_end()
            return
        except BaseException:
            self.slots.release()
            raise
        # At once, before any await: the run's end (which cannot come before this) finds
        # its experiment, and waits until the trials below are claimed; its first block
        # (steps away) is judged with the pairs it carries.
        self._experiments[handle.id] = exp_id
        if (state := self._ab.get(handle.id)) is not None:
            state.prior = carried_of(view.budget)
        linked = self._linked[handle.id] = asyncio.Event()
        try:
            await asyncio.to_thread(queue.link_run, self.engine, experiment_id=exp_id,
                                    run_id=handle.id)
            for _ in view.arms:  # the job holds every arm's trial for its life
                await asyncio.to_thread(queue.claim, self.engine, owner=f"run:{handle.id}",
                                        lease_seconds=LEASE_SECONDS, experiment_id=exp_id)
        finally:
            linked.set()
