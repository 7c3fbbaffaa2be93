"""The run supervisor: records a run, launches its job, watches it and records how it ended.

It owns this node's jobs and their summaries. ``submit`` hands back a ``RunHandle``: the run's
id, its lead-rank events for whoever observes them (a forked trial's measurements, an
interleaved run's blocks) and an ``ended`` future, resolved once the exit is stored in the
database, so a waiter that wakes up finds the run and its events there. Events reach the
supervisor through the ingest router (``fold`` for every rank, ``deliver`` for the lead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traind.contracts.control import PROBE_REQUEST
from traind.daemon import admission
from traind.daemon.config import Settings, corpus_cache_dir, train_config
from traind.daemon.db import crud
from traind.daemon.runs import recovery
from traind.daemon.runs.checkpoints import checkpoint_at
from traind.daemon.runs.jobs import Job, JobExit
from traind.daemon.runs.summary import RunSummary
from traind.daemon.service import ShuttingDown
from traind.metrics.host import oversubscribed
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from sqlalchemy import Engine

    from traind.contracts.events import Event
    from traind.daemon.ingest.hub import EventHub
    from traind.daemon.tracing import NullRunTracer
    from traind.metrics.daemon import DaemonMetrics
    from traind.metrics.goodput import Goodput
    from traind.metrics.straggler import StepSkew, Straggler

log = logging.getLogger("traind")


@dataclass(frozen=True, slots=True)
class RunEnd:
    """How a run ended, as recorded: completed | failed | stopped | preempted."""

    state: str
    exit_code: int
    error: str | None


class RunHandle:
    """A submitted run: ``id``, ``observe(callback)`` for its lead-rank events from now on (pass
    ``observers`` to ``submit`` to see them from the first), and ``ended``."""

    __slots__ = ("_observers", "ended", "id")

    def __init__(self, run_id: int, observers: Sequence[Callable[[Event], None]] = ()) -> None:
        self.id = run_id
        self.ended: asyncio.Future[RunEnd] = asyncio.get_running_loop().create_future()
        self._observers = list(observers)

    def observe(self, callback: Callable[[Event], None]) -> None:
        self._observers.append(callback)

    def _deliver(self, event: Event) -> None:
        for callback in self._observers:
            callback(event)


class Supervisor:
    def __init__(self, *, settings: Settings, engine: Engine, var_dir: Path, node_name: str,
                 tracer: NullRunTracer, metrics: DaemonMetrics, hub: EventHub,
                 on_event: Callable[[int, Event], None],
                 flush: Callable[[], None]) -> None:
        """``on_event``: where a job's events go (the ingest router); ``flush``: writes what
        the daemon holds for the database (blocking), done before an exit is recorded."""
        self.settings, self.engine, self.var_dir = settings, engine, var_dir
        self.node_name = node_name  # which runs in a shared database are this daemon's own
        self.tracer, self.metrics, self.hub = tracer, metrics, hub
        self._on_event, self._flush = on_event, flush
        self.jobs: dict[int, Job] = {}
        self.summaries: dict[int, RunSummary] = {}
        self.handles: dict[int, RunHandle] = {}
        # Hooks called with each run's handle and config before its job starts (so they see
        # its first events): how the interleaved runner follows every interleaved run.
        self.launching: list[Callable[[RunHandle, TrainConfig], None]] = []
        # Called with a run's goodput each time its events change it, and at its end
        # (metrics/goodput.py; the node exports it to Prometheus).
        self.goodput_listeners: list[Callable[[int, Goodput], None]] = []
        # Called with each step's arrival skew and the straggler verdict after it, once every
        # rank's arrival is in (metrics/straggler.py).
        self.straggler_listeners: list[Callable[[int, StepSkew, Straggler], None]] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self._forget: set[int] = set()  # ended runs whose summary goes once it is written
        self.job_factory: Callable[..., Job] = Job  # a test's stand-in for torchrun's workers
        self.stopping = False  # from then on nothing starts; stopped jobs end "preempted"

    # -- what callers ask ----------------------------------------------------------------------

    def admit(self, cfg: TrainConfig) -> None:
        """``ConfigError`` naming each field that keeps ``cfg`` from running on this node
        (admission.py)."""
        admission.check(cfg, admission.resources(),
                        oversubscribe=self.settings.daemon.oversubscribe)

    async def submit(self, cfg: TrainConfig, *, kind: str | None = None,
                     observers: Sequence[Callable[[Event], None]] = ()) -> RunHandle:
        """Record a run, launch its workers and supervise them. ``kind``: ``trial`` for a
        forked or cluster trial (default: ``experiment`` for an interleaved job, else
        ``job``); ``observers`` get its lead-rank events from the first. ``ConfigError``
        (nothing recorded) for a job this node cannot run; ``ShuttingDown`` once the daemon
        is stopping."""
        if self.stopping:
            raise ShuttingDown("the daemon is shutting down: nothing new starts")
        await asyncio.to_thread(self.admit, cfg)
        kind = kind or ("experiment" if cfg.interleave.arms else "job")
        run_id = await asyncio.to_thread(
            crud.create_run, self.engine, name=cfg.job.name,
            config=train_config(cfg, default_out_dir=Path()).model_dump(mode="json"),
            kind=kind, node=self.node_name)
        train_cfg = train_config(cfg, default_out_dir=self.var_dir / "runs" / str(run_id),
                                 default_cache_dir=corpus_cache_dir(self.var_dir))
        out_dir = train_cfg.job.out_dir
        assert out_dir is not None
        await asyncio.to_thread(crud.set_out_dir, self.engine, run_id=run_id,
                                out_dir=str(out_dir))
        handle = RunHandle(run_id, observers)
        await self._launch(handle, train_cfg)
        return handle

    async def resume_preempted(self) -> list[int]:
        """Relaunch every preempted job (an interleaved experiment's run is its runner's to
        resume). Returns their ids."""
        resumed = []
        for run_id, config, out_dir in await asyncio.to_thread(
                crud.preempted_runs, self.engine, node=self.node_name):
            await self.resume(RunHandle(run_id), config, out_dir)
            resumed.append(run_id)
        return resumed

    async def resume(self, handle: RunHandle, config: dict[str, Any], out_dir: str) -> None:
        """Relaunch a preempted run in its own folder: it resumes from its newest complete
        checkpoint, under the same run id."""
        cfg = TrainConfig.model_validate(config)
        # The stored config has no folder of its own (it is recorded before one is made).
        cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={
            "out_dir": Path(out_dir), "resume": True})})
        train_cfg = train_config(cfg, default_out_dir=Path(out_dir),
                                 default_cache_dir=corpus_cache_dir(self.var_dir))
        log.info("run %d resumes after a preemption, in %s", handle.id, out_dir)
        await self._launch(handle, train_cfg)

    def running(self, run_id: int) -> bool:
        return run_id in self.jobs

    def out_dir(self, run_id: int) -> Path | None:
        """A running run's folder (None when it is not running here)."""
        job = self.jobs.get(run_id)
        return job.out_dir if job is not None else None

    async def stop(self, run_id: int) -> None:
        """Ask a running run to checkpoint and exit (a no-op when it is not running here)."""
        if (job := self.jobs.get(run_id)) is not None:
            await job.stop()

    def request_stop(self, run_id: int) -> bool:
        """``stop`` without waiting for the exit (a web request): False when the run is not
        running here. The task is kept, so ``close`` waits for it."""
        if run_id not in self.jobs:
            return False
        task = asyncio.get_running_loop().create_task(self.stop(run_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    def request_link_probe(self, run_id: int) -> bool:
        """Ask a running job to probe its rank-to-rank links at its next report step
        (contracts/control.PROBE_REQUEST): False when the run is not running here or has one
        rank (no link to measure)."""
        job = self.jobs.get(run_id)
        cfg = getattr(job, "cfg", None)
        if job is None or cfg is None or cfg.job.nproc_per_node * cfg.job.nnodes < 2:
            return False
        (Path(job.out_dir) / PROBE_REQUEST).touch()
        return True

    def worker_pids(self) -> list[int]:
        return [pid for job in list(self.jobs.values()) for pid in job.worker_pids()]

    async def close(self) -> None:
        """Stop every job and wait until each exit is recorded."""
        self.stopping = True
        await asyncio.gather(*(job.stop() for job in list(self.jobs.values())))
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=60)

    # -- events (from the router, on the event loop) -------------------------------------------

    def lead(self, run_id: int, rank: int) -> bool:
        summary = self.summaries.get(run_id)
        return summary is None or summary.lead(rank)

    def fold(self, run_id: int, event: Event) -> None:
        """Every rank's event into the run's summary."""
        changes = self.summaries[run_id].observe(event)
        if changes.goodput is not None:
            self._tell_goodput(run_id, changes.goodput)
        if changes.skew is not None and changes.straggler is not None:
            for listener in self.straggler_listeners:
                listener(run_id, changes.skew, changes.straggler)

    def _tell_goodput(self, run_id: int, figures: Goodput) -> None:
        for listener in self.goodput_listeners:
            listener(run_id, figures)

    def deliver(self, run_id: int, event: Event) -> None:
        """A lead-rank event to the run's handle's observers."""
        if (handle := self.handles.get(run_id)) is not None:
            handle._deliver(event)

    def tokens_per_second(self, run_id: int) -> float:
        return self.summaries[run_id].tokens_per_second

    def goodput(self, run_id: int) -> dict[str, Any] | None:
        """The run's goodput as its summary holds it (None before its first report)."""
        summary = self.summaries.get(run_id)
        return summary.goodput if summary is not None else None

    def world_size(self, run_id: int) -> int:
        """The run's ranks as its start reported them (1 before)."""
        summary = self.summaries.get(run_id)
        return summary.world_size if summary is not None else 1

    def check_host(self, runnable: Callable[[], int | None], cpus: Callable[[], int]) -> None:
        """Count one host check (blocking reads: the flush thread calls it) into each run
        that trains now: were more threads runnable than CPUs usable (metrics/host.py)?
        Nothing is read while no run trains."""
        training = [s for run_id, s in list(self.summaries.items())
                    if run_id in self.jobs and s.training]
        if not training or (now := runnable()) is None:
            return
        over = oversubscribed(now, cpus())
        for summary in training:
            summary.note_host(over)

    def flush_summaries(self) -> None:
        """Write every changed summary (blocking); one that fails is written next time. A
        forgotten run's summary leaves memory once written (the DB has it)."""
        for run_id, summary in list(self.summaries.items()):
            if summary.dirty:
                summary.dirty = False
                try:
                    crud.update_summary(self.engine, run_id=run_id, summary=summary.as_dict())
                except BaseException:
                    summary.dirty = True  # written at the next flush that gets through
                    raise
            if run_id in self._forget:
                self._forget.discard(run_id)
                self.summaries.pop(run_id, None)

    def forget(self, run_id: int) -> None:
        """An ended run's summary is not needed in memory any more (the node calls it a
        retention after the end, when every late writer, e.g. a verdict, is done)."""
        if run_id not in self.jobs:
            self._forget.add(run_id)

    # -- a run's life --------------------------------------------------------------------------

    async def _launch(self, handle: RunHandle, train_cfg: TrainConfig) -> None:
        run_id = handle.id
        out_dir = train_cfg.job.out_dir
        assert out_dir is not None
        self.summaries[run_id] = RunSummary(total_steps=train_cfg.job.steps,
                                            ranks_per_node=train_cfg.job.nproc_per_node)
        self.tracer.start_run(run_id, train_cfg)
        iface = self.settings.daemon.node_iface
        job = self.job_factory(train_cfg, Path(out_dir), lambda e: self._on_event(run_id, e),
                  log_lines=self.settings.daemon.log_lines,
                  env={"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface} if iface
                  else None)
        # Before the launch: its first events must not be missed.
        self.handles[run_id] = handle
        for hook in self.launching:
            hook(handle, train_cfg)
        self.summaries[run_id].launched(time.time())
        try:
            await job.start()
        except BaseException as exc:
            self.handles.pop(run_id, None)
            error = f"launch failed: {exc}"
            self.tracer.end_run(run_id, state="failed", error=error)
            handle.ended.set_result(RunEnd("failed", -1, error))
            raise
        self.jobs[run_id] = job
        await asyncio.to_thread(crud.mark_running, self.engine, run_id=run_id)
        self.metrics.running.inc()
        self.hub.publish({"type": "run", "run": run_id, "state": "running",
                          "name": train_cfg.job.name})
        task = asyncio.create_task(self._supervise(handle, job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        log.info("run %d started: %s (pid %s)", run_id, train_cfg.job.name, job.pid)

    async def _supervise(self, handle: RunHandle, job: Job) -> None:
        exit_ = await job.wait()
        end = RunEnd(exit_.state, exit_.code, exit_.describe())
        try:
            end = await self._record_exit(handle.id, job, exit_)
        finally:
            # Last, so whoever wakes up finds the run and its events stored; and whatever
            # failed above, nobody is left waiting forever.
            self.handles.pop(handle.id, None)
            handle.ended.set_result(end)

    async def _record_exit(self, run_id: int, job: Job, exit_: JobExit) -> RunEnd:
        state = exit_.state
        finished = self.summaries[run_id].finished_step
        if (state == "stopped" and self.stopping and finished is not None
                and await asyncio.to_thread(checkpoint_at, job.out_dir, finished)):
            # Decided from the checkpoint, not the exit code: torchrun exits non-zero even
            # when every rank saved and left cleanly.
            state = "preempted"
        self.tracer.end_run(run_id, state=state, exit_code=exit_.code,
                            error=exit_.describe())
        self.jobs.pop(run_id, None)
        self.metrics.running.dec()
        self.metrics.runs.labels(state).inc()
        self.metrics.malformed.inc(job.bad_events)
        if (figures := self.summaries[run_id].ended(time.time())) is not None:
            self._tell_goodput(run_id, figures)
        await asyncio.to_thread(self._flush)
        # Everything the ranks sent is read (wait() drains the socket) and now stored.
        await asyncio.to_thread(recovery.discard, job.out_dir)
        await asyncio.to_thread(crud.mark_finished, self.engine, run_id=run_id,
                                state=state, exit_code=exit_.code, error=exit_.describe())
        self.hub.publish({"type": "run", "run": run_id, "state": state})
        log.info("run %d %s (exit code %d)", run_id, state, exit_.code)
        return RunEnd(state, exit_.code, exit_.describe())
