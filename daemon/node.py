"""The composition root: one node's engine, registry, hub and jobs, wired once.

Nothing else builds these. ``Node`` implements ``daemon.service.NodeService`` for the web layer
and is the single writer of the database and the only exporter of metrics: worker events arrive
through ``Job`` callbacks on the event loop, update the registry and the hub at once, and reach
the database in batches from a background flush (never one write per step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import uvicorn
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

from traind import __version__
from traind.daemon import admission, queue
from traind.daemon.auth import load_or_create_token, token_matches, write_login_link
from traind.daemon.autotune.runner import AutoTuner
from traind.daemon.config import ConfigError, Settings, corpus_cache_dir, train_config
from traind.daemon.db import crud
from traind.daemon.db.engine import default_url, make_engine
from traind.daemon.db.migrate import upgrade
from traind.daemon.experiments.ab import Block, evaluate
from traind.daemon.experiments.cluster import SlotRunner
from traind.daemon.experiments.forked import MIN_BASE_STEPS, ForkedRunner, TrialTrace, step_of
from traind.daemon.experiments.specs import (
    LEASE_SECONDS,
    OWNER_PREFIX,
    experiment_config,
    forked_configs,
    info,
    refuse_paths,
    run_of,
    starting_checkpoint,
)
from traind.daemon.ingest.event_buffer import EventBuffer
from traind.daemon.ingest.hub import EventHub
from traind.daemon.notify import Notifier
from traind.daemon.promotions import (
    Guard,
    changes,
    current_setting,
    list_promotions,
    promote,
)
from traind.daemon.runs.jobs import Job, JobExit
from traind.daemon.runs.summary import RunSummary
from traind.daemon.service import (
    PAGE,
    AutotuneInfo,
    AutotuneSpec,
    ExperimentInfo,
    ExperimentSpec,
    MetricSample,
    PromotionView,
    QueuedTrial,
    RunView,
    ShuttingDown,
)
from traind.daemon.tracing import build_tracer_provider, run_tracer
from traind.metrics.daemon import DaemonMetrics
from traind.metrics.gpu import GpuCollector
from traind.metrics.host import HostCollector
from traind.metrics.scheduler import SchedulerCollector
from traind.metrics.training import TrainingMetrics
from traind.trainer.checkpoint import latest
from traind.trainer.config import TrainConfig
from traind.trainer.events import (
    ArmEvent,
    EvalEvent,
    Event,
    LifecycleEvent,
    PrecisionEvent,
    SNREvent,
    StepEvent,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

log = logging.getLogger("traind")
FLUSH_SECONDS = 1.0
# The systemd watchdog is fed only while the flush loop has turned this recently.
SUPERVISOR_STALE_SECONDS = 30.0
# EXTEND_TIMEOUT_USEC while jobs checkpoint on stop, for at most this long in all.
STOP_EXTEND_SECONDS = 600.0
# Live websockets are pinged this often, and closed when a ping waits this long for its pong.
WS_PING_SECONDS = 20.0


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT once it has shut down, which would end the daemon
    before it stops its jobs (orphaning the workers). The node handles those signals itself:
    they ask the server to exit, then ``Node.serve`` stops every job and returns."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Node:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # First: a bad tracing set-up fails before anything is half-built.
        self.tracer_provider = build_tracer_provider(settings.metrics,
                                                     service_version=__version__)
        self.tracer = run_tracer(self.tracer_provider,
                                 steps_every=settings.metrics.trace_steps_every)
        self.var_dir = settings.daemon.var_dir.resolve()
        self.var_dir.mkdir(parents=True, exist_ok=True)
        self.db_url = settings.daemon.db_url or default_url(self.var_dir)
        self.token, self.token_created = load_or_create_token(self.var_dir)
        self.engine = make_engine(self.db_url)
        self.hub = EventHub(capacity=settings.daemon.live_points)
        # No `_created` series: they double every counter for a value nobody charts (a
        # process-wide switch in prometheus_client; the daemon is the only exporter).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.training = TrainingMetrics(self.registry)
        self.daemon_metrics = DaemonMetrics(
            self.registry, version=__version__, torch_version=torch.__version__,
            hub_dropped=lambda: self.hub.dropped, subscribers=lambda: self.hub.subscribers,
            db_pending=lambda: self._events.pending)
        self.registry.register(HostCollector(self._worker_pids))
        self.registry.register(SchedulerCollector(
            lambda: queue.experiments_by_state(self.engine),
            lambda: queue.queue_depth(self.engine),
            lambda: queue.lease_expiries(self.engine)))
        self.gpu = (GpuCollector(per_link=settings.metrics.per_link) if settings.metrics.gpu
                    else None)  # NVML only: the daemon never initialises CUDA
        if self.gpu is not None:
            self.registry.register(self.gpu)
        # The daemon process as every Python exporter shows it (process_*, python_gc_*).
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.jobs: dict[int, Job] = {}
        self._summaries: dict[int, RunSummary] = {}
        self._snr_windows: dict[int, int] = {}  # run -> the last SNR window sent to the hub
        self._experiments: dict[int, int] = {}  # run id -> experiment id
        self._interleaved_lock = asyncio.Lock()
        self._ab: dict[int, tuple[list[str], float, list[Block]]] = {}  # arms, margin, blocks
        # Run events on their way to the database: kept (in memory, then spilled under var/)
        # while it refuses writes, and written once it accepts them again.
        self._events = EventBuffer(self.var_dir / "pending-events.jsonl")
        self._traces: dict[int, TrialTrace] = {}  # run id -> its forked trial's measurements
        self._tasks: set[asyncio.Task[Any]] = set()
        self.forked = ForkedRunner(self)
        self.tuner = AutoTuner(self)
        self.cluster = SlotRunner(self) if settings.daemon.cluster else None
        # Which runs in a shared database are this daemon's own.
        self.node_name = settings.daemon.node_addr or socket.gethostname()
        self.guard = Guard(self.engine, self._out_dir)
        self._ready = False
        self._stopping = False
        self._heartbeat = time.monotonic()  # see _alive

    # -- lifecycle ---------------------------------------------------------------------------

    def migrate(self) -> None:
        upgrade(self.db_url)
        if n := crud.mark_interrupted(self.engine, resumable=_has_checkpoint,
                                      node=self.node_name):
            log.info("%d runs of a previous daemon ended with it (preempted if resumable)", n)

    async def serve(self) -> None:
        """Migrate, start the web server and the default job; on shutdown stop every job."""
        from traind.web.app import create_app  # daemon -> web; web never imports the node
        from traind.web.sessions import Sessions

        await asyncio.to_thread(self.migrate)
        d = self.settings.daemon
        sessions = Sessions()
        write_login_link(self.var_dir, d.host, d.port, sessions.login_code())
        server = _Server(uvicorn.Config(
            create_app(self, allowed_hosts=[d.host, *d.allowed_hosts], sessions=sessions,
                       open_pages=d.open_pages), host=d.host,
            port=d.port, log_level="warning",
            access_log=False, ws="websockets-sansio", lifespan="on",
            # A page that stops reading is let go once a ping goes unanswered: its kernel and
            # transport buffers (megabytes on loopback) would otherwise be held for as long as
            # it stays connected. The hub's bounded queue covers the time until then.
            ws_ping_interval=WS_PING_SECONDS, ws_ping_timeout=WS_PING_SECONDS))
        flusher = asyncio.create_task(self._flush_forever())
        notifier = Notifier.from_env()  # before any job: children must not inherit it
        systemd = asyncio.create_task(notifier.run(
            started=lambda: server.started, alive=self._alive,
            status=f"serving on {d.host}:{d.port}"))
        loop = asyncio.get_running_loop()

        def stop(sig: signal.Signals) -> None:
            # From the signal on, nothing new starts: the server may take a while to close
            # its connections, and a runner would launch its next trial meanwhile.
            self._stopping = True
            server.handle_exit(sig, None)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        try:
            # Forked experiments a previous daemon left unfinished carry on (their trials'
            # leases run out and are claimed again).
            for exp_id in await asyncio.to_thread(self._unfinished_forked):
                self.forked.start(exp_id)
            for tune_id in await asyncio.to_thread(self.tuner.unfinished):
                self.tuner.start(tune_id)
            if self.cluster is not None:
                self.cluster.start()
            resumed = await self.resume_preempted()
            await self._start_interleaved()  # those a previous daemon left queued
            if d.default_job and not resumed:  # a resumed run is the node's job already
                try:
                    await self.submit(self.settings)
                except ConfigError as exc:  # the daemon serves on: fix the config, restart
                    log.error("the configured job was not started: %s", exc)
            self._ready = True
            await server.serve()
        finally:
            self._ready = False
            notifier.stopping("stopping jobs (checkpointing)")
            async with notifier.extending(limit=STOP_EXTEND_SECONDS):
                await self.shutdown()
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await asyncio.to_thread(self._flush)
            if self.tracer_provider is not None:
                await asyncio.to_thread(self.tracer_provider.shutdown)  # flushes the batch
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            systemd.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await systemd
            notifier.close()

    async def shutdown(self) -> None:
        self._stopping = True  # jobs that checkpoint on the way out end "preempted"
        await self.tuner.close()  # first: it would submit its next round meanwhile
        if self.cluster is not None:
            await self.cluster.close()
        await self.forked.close()  # first: a runner would launch its next trial meanwhile
        await asyncio.gather(*(job.stop() for job in list(self.jobs.values())))
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=60)
        self.tracer.close()  # ends the spans of runs whose exit was never seen
        if self.gpu is not None:
            self.gpu.close()

    def admit(self, cfg: TrainConfig) -> None:
        """``ConfigError`` naming each field that keeps ``cfg`` from running on this node
        (admission.py)."""
        found = admission.problems(cfg, admission.resources(),
                                   oversubscribe=self.settings.daemon.oversubscribe)
        if found:
            raise ConfigError("this node cannot run the job:\n" + "\n".join(
                f"  {line}" for line in found))

    async def submit(self, cfg: TrainConfig, *, trace: TrialTrace | None = None) -> int:
        """Record a run, launch its workers and supervise them. Returns the run id.
        ``trace``: a forked trial's; it gets the job's rank-0 events and, last, its end.
        ``ConfigError`` (nothing recorded) for a job this node cannot run; ``ShuttingDown``
        once the daemon is stopping."""
        if self._stopping:
            raise ShuttingDown("the daemon is shutting down: nothing new starts")
        await asyncio.to_thread(self.admit, cfg)
        kind = "trial" if trace is not None else "experiment" if cfg.interleave.arms else "job"
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
        await self._launch(run_id, train_cfg, trace)
        return run_id

    async def resume_preempted(self) -> list[int]:
        """Relaunch every preempted run in its own folder (it resumes from its newest complete
        checkpoint, under the same run id). Returns their ids."""
        resumed = []
        for run_id, config, out_dir in await asyncio.to_thread(
                crud.preempted_runs, self.engine, node=self.node_name):
            cfg = TrainConfig.model_validate(config)
            # The stored config has no folder of its own (it is recorded before one is made).
            cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={
                "out_dir": Path(out_dir), "resume": True})})
            train_cfg = train_config(cfg, default_out_dir=Path(out_dir),
                                     default_cache_dir=corpus_cache_dir(self.var_dir))
            log.info("run %d resumes after a preemption, in %s", run_id, out_dir)
            await self._launch(run_id, train_cfg, None)
            resumed.append(run_id)
        return resumed

    async def _launch(self, run_id: int, train_cfg: TrainConfig,
                      trace: TrialTrace | None) -> None:
        out_dir = train_cfg.job.out_dir
        assert out_dir is not None
        self._summaries[run_id] = RunSummary(total_steps=train_cfg.job.steps,
                                             ranks_per_node=train_cfg.job.nproc_per_node)
        self.tracer.start_run(run_id, train_cfg)
        if train_cfg.interleave.arms:
            self._ab[run_id] = ([a.name for a in train_cfg.interleave.arms],
                                train_cfg.interleave.loss_margin, [])
        iface = self.settings.daemon.node_iface
        job = Job(train_cfg, Path(out_dir), lambda e: self._on_event(run_id, e),
                  log_lines=self.settings.daemon.log_lines,
                  env={"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface} if iface
                  else None)
        if trace is not None:  # before the launch: its first events must not be missed
            self._traces[run_id] = trace
        try:
            await job.start()
        except BaseException as exc:
            self._traces.pop(run_id, None)
            self.tracer.end_run(run_id, state="failed", error=f"launch failed: {exc}")
            raise
        self.jobs[run_id] = job
        await asyncio.to_thread(crud.mark_running, self.engine, run_id=run_id)
        self.daemon_metrics.running.inc()
        self.hub.publish({"type": "run", "run": run_id, "state": "running",
                          "name": train_cfg.job.name})
        task = asyncio.create_task(self._supervise(run_id, job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("run %d started: %s (pid %s)", run_id, train_cfg.job.name, job.pid)

    async def _supervise(self, run_id: int, job: Job) -> None:
        exit_ = await job.wait()
        try:
            await self._record_exit(run_id, job, exit_)
        finally:
            # Last, so a forked runner that wakes up finds the run and its events stored;
            # and whatever failed above, the runner is not left waiting forever.
            if (trace := self._traces.pop(run_id, None)) is not None:
                trace.end(exit_.state, exit_.describe())

    async def _record_exit(self, run_id: int, job: Job, exit_: JobExit) -> None:
        state = exit_.state
        finished = self._summaries[run_id].finished_step
        if (state == "stopped" and self._stopping and finished is not None
                and await asyncio.to_thread(_checkpoint_at, job.out_dir, finished)):
            # Decided from the checkpoint, not the exit code: torchrun exits non-zero even
            # when every rank saved and left cleanly.
            state = "preempted"
        self.tracer.end_run(run_id, state=state, exit_code=exit_.code,
                            error=exit_.describe())
        self.jobs.pop(run_id, None)
        self.daemon_metrics.running.dec()
        self.daemon_metrics.runs.labels(state).inc()
        self.daemon_metrics.malformed.inc(job.bad_events)
        self._judge(run_id, finished=exit_.state == "completed")
        ended_experiment = run_id in self._experiments
        await asyncio.to_thread(self._end_experiment, run_id, state)
        self._ab.pop(run_id, None)
        await asyncio.to_thread(self._flush)
        await asyncio.to_thread(crud.mark_finished, self.engine, run_id=run_id,
                                state=state, exit_code=exit_.code, error=exit_.describe())
        self.hub.publish({"type": "run", "run": run_id, "state": state})
        log.info("run %d %s (exit code %d)", run_id, state, exit_.code)
        if ended_experiment:  # its slot is free: the next queued one starts
            await self._start_interleaved()

    # -- events (on the event loop; nothing here blocks) --------------------------------------

    def _on_event(self, run_id: int, event: Event) -> None:
        self.daemon_metrics.events.labels(event.kind).inc()
        self.training.observe(run_id, event)
        summary = self._summaries[run_id]
        summary.observe(event)
        self.tracer.observe(run_id, event)  # filters ranks itself
        self.guard.observe(run_id, event)  # so does the promotions' guard
        if not summary.lead(event.rank):
            return
        if (trace := self._traces.get(run_id)) is not None:
            trace.observe(event)
        if isinstance(event, StepEvent):
            self.hub.publish({
                "type": "step", "run": run_id, "step": event.step, "loss": event.loss,
                "lr": event.lr, "grad_norm": event.grad_norm,
                "tokens_per_second": summary.tokens_per_second,
                "step_seconds": event.step_seconds, "time": event.time})
        elif isinstance(event, EvalEvent):
            self.hub.publish({"type": "eval", "run": run_id, "step": event.step,
                              "val_loss": event.val_loss, "time": event.time})
            self._events.add(run_id, {"kind": "eval", "step": event.step,
                                      "value": event.val_loss,
                                      "data": {"batches": event.batches}})
        elif isinstance(event, LifecycleEvent):
            self._events.add(run_id, {"kind": event.phase, "step": event.step,
                                      "data": event.detail})
        elif isinstance(event, ArmEvent):  # one row per block: the evidence for a verdict
            if run_id in self._ab:
                self._ab[run_id][2].append(Block(event.arm, event.block, event.tokens,
                                                 event.seconds, event.loss,
                                                 event.grad_error))
                self._judge(run_id, finished=False)
            self._events.add(run_id, {
                "kind": "arm", "step": event.step,
                "value": event.tokens / event.seconds if event.seconds > 0 else None,
                "data": {"arm": event.arm, "block": event.block, "steps": event.steps,
                         "tokens": event.tokens, "seconds": event.seconds,
                         "loss": event.loss if math.isfinite(event.loss) else None,
                         "grad_error": (event.grad_error if math.isfinite(event.grad_error)
                                        else None)}})
        elif isinstance(event, PrecisionEvent):  # rare, and the evidence for each switch
            self._events.add(run_id, {
                "kind": "precision", "step": event.step, "value": event.snr,
                "data": {"group": event.group, "before": event.before, "after": event.after}})
            self.hub.publish({"type": "precision", "run": run_id, "step": event.step,
                              "group": event.group, "before": event.before,
                              "after": event.after, "snr": _finite(event.snr)})
        # every report repeats the last window's figures: the page needs each window once
        elif (isinstance(event, SNREvent)
              and self._snr_windows.get(run_id) != event.window_step):
            self._snr_windows[run_id] = event.window_step
            self.hub.publish({"type": "snr", "run": run_id, "step": event.window_step,
                              "groups": event.groups, "snr": [_finite(v) for v in event.snr],
                              "modes": event.modes})

    def _judge(self, run_id: int, *, finished: bool) -> None:
        """The interleaved run's verdict so far, into its summary (pure math, microseconds)."""
        if run_id not in self._ab:
            return
        arms, margin, blocks = self._ab[run_id]
        try:
            result = evaluate(blocks, arms, finished=finished, loss_margin=margin)
        except ValueError as exc:  # e.g. a block with no throughput: say so, do not crash
            result = {a: {"kind": "failed (error)", "reason": str(exc)} for a in arms[1:]}
        summary = self._summaries[run_id]
        summary.ab, summary.dirty = result, True

    async def _flush_forever(self) -> None:
        refused_since: float | None = None  # the outage being reported, once
        while True:
            self._heartbeat = time.monotonic()  # a flush that hangs leaves it stale
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                await asyncio.to_thread(self._flush)
            except Exception as exc:
                if refused_since is None:
                    refused_since = time.monotonic()
                    log.error("the database refuses writes (%s); %d run events are held "
                              "and retried every %.0f s", str(exc).splitlines()[0][:200],
                              self._events.pending, FLUSH_SECONDS)
            else:
                if refused_since is not None:
                    log.warning("the database accepts writes again after %.0f s; the held "
                                "events are stored", time.monotonic() - refused_since)
                    refused_since = None

    def _flush(self) -> None:
        self._events.flush(lambda run_id, events: crud.add_events(
            self.engine, run_id=run_id, events=events))
        for run_id, summary in list(self._summaries.items()):
            if summary.dirty:
                summary.dirty = False
                try:
                    crud.update_summary(self.engine, run_id=run_id, summary=summary.as_dict())
                except BaseException:
                    summary.dirty = True  # written at the next flush that gets through
                    raise

    def _worker_pids(self) -> list[int]:
        return [pid for job in list(self.jobs.values()) for pid in job.worker_pids()]

    # -- NodeService ---------------------------------------------------------------------------

    def runs(self, *, limit: int = PAGE, offset: int = 0) -> list[RunView]:
        return crud.list_runs(self.engine, limit=limit, offset=offset)

    def live_snapshot(self) -> dict[str, Any]:
        return self.hub.snapshot()

    def subscribe(self) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        return self.hub.subscribe()

    def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        start = time.perf_counter()
        body = encoder(self.registry)
        # Reported by the next scrape: a scrape cannot contain its own duration.
        self.daemon_metrics.scrape_seconds.set(time.perf_counter() - start)
        self.daemon_metrics.scrape_series.set(
            sum(1 for line in body.splitlines() if line and not line.startswith(b"#")))
        return body, content_type

    def samples(self, prefix: str) -> list[MetricSample]:
        return [MetricSample(s.name, dict(s.labels), s.value)
                for fam in self.registry.collect() if fam.name.startswith(prefix)
                for s in fam.samples if s.name.startswith(prefix)]

    async def submit_experiment(self, spec: ExperimentSpec) -> ExperimentInfo:
        if self._stopping:
            raise ShuttingDown("the daemon is shutting down: submit again once it is back")
        if spec.mode != "interleaved":
            return await self._submit_forked(spec)
        # ConfigError before anything is written; validating a config takes milliseconds, so
        # it runs off the loop too (a burst of submissions would otherwise stall it).
        cfg = await asyncio.to_thread(experiment_config, self.settings, spec)
        await asyncio.to_thread(self.admit, cfg)
        arms = [{"name": a.name, "baseline": i == 0,
                 "overrides": {"compression": a.compression, "precision": a.precision}}
                for i, a in enumerate(cfg.interleave.arms)]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        exp_id = await asyncio.to_thread(
            queue.create_experiment, self.engine, name=spec.name, mode="interleaved",
            base_config=cfg.model_dump(mode="json"), arms=arms,
            budget={"steps": spec.steps, "block_steps": spec.block_steps},
            traind_version=__version__, torch_version=torch.__version__, device=device)
        await self._start_interleaved()  # now, or when a running one ends (it stays queued)
        found = await asyncio.to_thread(self.experiment, exp_id)  # a read: off the loop
        assert found is not None
        return found

    async def _start_interleaved(self) -> None:
        """Start queued interleaved experiments, oldest first, while fewer than
        ``daemon.max_experiment_jobs`` run (each is a job of its own: at once they would
        share the node's cores and measure each other)."""
        async with self._interleaved_lock:
            while (len(self._experiments) < self.settings.daemon.max_experiment_jobs
                   and not self._stopping):
                started = set(self._experiments.values())
                waiting = [i for i in await asyncio.to_thread(
                    queue.experiment_ids, self.engine, mode="interleaved", states=("queued",))
                    if i not in started]
                if not waiting:
                    return
                await self._start_one_interleaved(waiting[0])

    async def _start_one_interleaved(self, exp_id: int) -> None:
        view = await asyncio.to_thread(queue.get_experiment, self.engine,
                                       experiment_id=exp_id)
        assert view is not None
        try:
            run_id = await self.submit(TrainConfig.model_validate(view.base_config))
        except ConfigError as exc:  # the node changed since it was admitted: say why
            log.error("interleaved experiment %d cannot start: %s", exp_id, exc)
            await asyncio.to_thread(queue.cancel_experiment, self.engine,
                                    experiment_id=exp_id)
            return
        for _ in view.arms:  # the job holds every arm's trial for its life
            await asyncio.to_thread(queue.claim, self.engine, owner=f"{OWNER_PREFIX}{run_id}",
                                    lease_seconds=LEASE_SECONDS, experiment_id=exp_id)
        self._experiments[run_id] = exp_id

    async def _submit_forked(self, spec: ExperimentSpec) -> ExperimentInfo:
        """Record a forked experiment (its trials queue in ABBA order) and start its runner.
        Every arm's job config is checked first: nothing is recorded for a bad one."""
        known = spec.checkpoint_run is not None and await asyncio.to_thread(
            crud.get_run, self.engine, run_id=spec.checkpoint_run) is not None
        # ConfigError names the field; the checkpoint is resolved from ids under var_dir.
        base, _ = await asyncio.to_thread(forked_configs, self.settings, spec, run_known=known)
        # The arms change compression, precision and bucket size only: what admission looks at
        # (device, ranks, threads, model and batch) is the base's.
        await asyncio.to_thread(self.admit, base)
        start = starting_checkpoint(self.settings, spec, run_known=known)
        arms = [{"name": a.get("name"), "baseline": i == 0,
                 "overrides": {"compression": dict(a.get("compression") or {}),
                               "precision": a.get("precision"),
                               **({"bucket_mb": a["bucket_mb"]} if a.get("bucket_mb") else {})}}
                for i, a in enumerate(spec.arms)]
        checkpoint = str(start) if start is not None else None
        budget = {"steps": spec.steps, "repeats": spec.repeats, "loss_margin": spec.loss_margin,
                  # No checkpoint given: a base job of this many steps makes one, and each
                  # trial's result names it.
                  "checkpoint": checkpoint,
                  "base_steps": None if checkpoint else max(MIN_BASE_STEPS, spec.block_steps)}
        device = "cuda" if torch.cuda.is_available() else "cpu"
        exp_id = await asyncio.to_thread(
            queue.create_experiment, self.engine, name=spec.name, mode="forked",
            base_config=base.model_dump(mode="json"), arms=arms, budget=budget,
            repeats=spec.repeats, traind_version=__version__, torch_version=torch.__version__,
            device=device)
        self.forked.start(exp_id)
        found = await asyncio.to_thread(self.experiment, exp_id)
        assert found is not None
        return found

    def _unfinished_forked(self) -> list[int]:
        return queue.experiment_ids(self.engine, mode="forked", states=("queued", "running"))

    def experiments(self, *, limit: int = PAGE, offset: int = 0) -> list[ExperimentInfo]:
        return [self._info(v) for v in
                queue.list_experiments(self.engine, limit=limit, offset=offset)]

    def experiment(self, experiment_id: int) -> ExperimentInfo | None:
        view = queue.get_experiment(self.engine, experiment_id=experiment_id)
        return self._info(view) if view else None

    async def cancel_experiment(self, experiment_id: int) -> bool:
        found = await asyncio.to_thread(self.experiment, experiment_id)
        if found is None or found.state not in ("queued", "running"):
            return False
        await asyncio.to_thread(queue.cancel_experiment, self.engine,
                                experiment_id=experiment_id)
        if found.run_id is not None and (job := self.jobs.get(found.run_id)) is not None:
            await job.stop()
        await self.forked.cancel(experiment_id)  # a forked one's current job (or base job)
        return True

    # -- auto-tuning and promotions ------------------------------------------------------------

    async def submit_autotune(self, spec: AutotuneSpec) -> AutotuneInfo:
        # Up front, so the error names overrides.<path> rather than each round's candidate.
        refuse_paths(spec.overrides)
        for i, c in enumerate(spec.compressions):
            refuse_paths({"compression": c}, where=f"compressions.{i}")
        return await self.tuner.submit(spec)

    def autotunes(self, *, limit: int = PAGE, offset: int = 0) -> list[AutotuneInfo]:
        return self.tuner.list(limit=limit, offset=offset)

    def autotune(self, tune_id: int) -> AutotuneInfo | None:
        return self.tuner.get(tune_id)

    async def cancel_autotune(self, tune_id: int) -> bool:
        return await self.tuner.cancel(tune_id)

    def promotions(self, run_id: int | None = None, *, limit: int = PAGE, offset: int = 0
                   ) -> list[PromotionView]:
        return list_promotions(self.engine, run_id=run_id, limit=limit, offset=offset)

    async def promote(self, run_id: int, setting: dict[str, Any], *,
                      evidence: dict[str, Any], autotune_id: int | None = None) -> int | None:
        """Hand ``setting`` to run ``run_id`` at its next checkpoint boundary (None: the run
        already trains with it, or it is not running here)."""
        out_dir = self._out_dir(run_id)
        config = await asyncio.to_thread(crud.run_config, self.engine, run_id=run_id)
        if out_dir is None or config is None:
            return None
        previous = await asyncio.to_thread(current_setting, self.engine, run_id, config)
        if not changes(previous, setting):
            return None
        return await asyncio.to_thread(
            promote, self.engine, run_id=run_id, out_dir=out_dir, setting=setting,
            previous=previous, evidence=evidence, autotune_id=autotune_id)

    def queued_trials(self, *, limit: int = PAGE, offset: int = 0) -> list[QueuedTrial]:
        return [QueuedTrial(t.id, t.experiment_id, name, t.arm_name, t.repeat, t.priority)
                for t, name in queue.waiting_trials(self.engine, limit=limit, offset=offset)]

    def reorder_trials(self, trial_ids: list[int]) -> None:
        queue.reorder(self.engine, trial_ids_in_order=trial_ids)

    def _out_dir(self, run_id: int) -> Path | None:
        job = self.jobs.get(run_id)
        return job.out_dir if job is not None else None

    def check_token(self, token: str | None) -> bool:
        return token_matches(self.token, token)

    def _info(self, view: queue.ExperimentView) -> ExperimentInfo:
        trials = queue.list_trials(self.engine, experiment_id=view.id)
        run = run_of(trials)
        live = self._summaries[run].ab if run in self._summaries else None
        return info(view, trials, live or None)

    def _end_experiment(self, run_id: int, state: str) -> None:
        """The job of an experiment ended: each arm's trial gets its blocks, the experiment
        its verdict (unless it was cancelled meanwhile)."""
        exp_id = self._experiments.pop(run_id, None)
        if exp_id is None:
            return
        verdict = self._summaries[run_id].ab
        blocks = self._ab.get(run_id, ([], 0.0, []))[2]
        for t in queue.list_trials(self.engine, experiment_id=exp_id):
            mine = [b for b in blocks if b.arm == t.arm_name]
            queue.complete(self.engine, trial_id=t.id, attempt=t.attempt, result={
                "blocks": len(mine), "tokens": sum(b.tokens for b in mine),
                "seconds": sum(b.seconds for b in mine)})
        queue.finish_experiment(self.engine, experiment_id=exp_id, verdict=verdict,
                                state="done" if state == "completed" else "failed")

    def _alive(self) -> bool:
        """For the systemd watchdog: the supervisor's flush loop (which also proves a worker
        thread and the database answer) turned lately. The event loop is proven by the ping
        itself, sent from a task on it."""
        return time.monotonic() - self._heartbeat < SUPERVISOR_STALE_SECONDS

    def health(self) -> dict[str, Any]:
        return {"ok": self._ready, "version": __version__, "runs_running": len(self.jobs)}


def _has_checkpoint(out_dir: str) -> bool:
    return latest(Path(out_dir)) is not None


def _checkpoint_at(out_dir: Path, step: int) -> bool:
    """Whether the newest complete checkpoint in ``out_dir`` is the one of ``step``."""
    found = latest(out_dir)
    return found is not None and step_of(found) == step


def _finite(value: float) -> float | None:
    """A figure for the browser's JSON.parse, which has no NaN or Infinity: None instead."""
    return value if math.isfinite(value) else None
