"""The composition root: one node's engine, registry, hub, supervisor, router and runners.

Nothing else builds these, and ``Node`` only wires them: runs are the supervisor's
(``daemon/runs/``), worker events enter through the router (``daemon/ingest/``) and reach the
database in batches from the flush loop (never one write per step), experiments and the
auto-tuner are their runners'. ``Node`` implements ``daemon.service.NodeService`` for the web
layer by delegating, and is the single writer of the database and the only exporter of metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

import uvicorn
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from traind import __version__
from traind.daemon.auth import load_or_create_token, write_login_link
from traind.daemon.autotune.runner import AutoTuner
from traind.daemon.config import ConfigError, Settings
from traind.daemon.db import crud, queue
from traind.daemon.db.engine import default_url, make_engine
from traind.daemon.db.migrate import upgrade
from traind.daemon.experiments.cluster import SlotRunner
from traind.daemon.experiments.forked import ForkedRunner
from traind.daemon.experiments.interleaved import InterleavedRunner
from traind.daemon.experiments.service import Ends, Experiments
from traind.daemon.experiments.slots import Slots
from traind.daemon.facade import Facade
from traind.daemon.ingest.comm_history import CommHistory
from traind.daemon.ingest.event_buffer import EventBuffer
from traind.daemon.ingest.flush import Flusher
from traind.daemon.ingest.hardware_history import HardwareHistory
from traind.daemon.ingest.hub import EventHub
from traind.daemon.ingest.router import HubFeed, Router, store_feed
from traind.daemon.ingest.series import SeriesRecorder
from traind.daemon.notify import Notifier
from traind.daemon.profiles.captures import Profiles
from traind.daemon.promotions import Guard
from traind.daemon.provenance import torch_build
from traind.daemon.runs import recovery
from traind.daemon.runs.checkpoints import has_checkpoint
from traind.daemon.runs.supervisor import RunHandle, Supervisor
from traind.daemon.tracing import build_tracer_provider, run_tracer
from traind.metrics.daemon import DaemonMetrics
from traind.metrics.goodput import NodeGoodput
from traind.metrics.gpu import GpuCollector
from traind.metrics.host import HostCollector, read_runnable
from traind.metrics.scheduler import SchedulerCollector
from traind.metrics.training import TrainingMetrics
from traind.trainer.threads import usable_cpus

if TYPE_CHECKING:
    from collections.abc import Iterator

    from traind.contracts.events import Event
    from traind.trainer.config import TrainConfig

log = logging.getLogger("traind")
# EXTEND_TIMEOUT_USEC while jobs checkpoint on stop, for at most this long in all.
STOP_EXTEND_SECONDS = 600.0


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
        # torch.cuda.is_available() (torchao calls it at import, when the tuner asks whether
        # fp8 can run) counts devices through NVML instead of initialising CUDA: the daemon
        # never holds a CUDA context, and workers forked after it need none of its.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
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
        # Run events on their way to the database: kept (in memory, then spilled under var/)
        # while it refuses writes, and written once it accepts them again.
        self.events = EventBuffer(self.var_dir / "pending-events.jsonl")
        # No `_created` series: they double every counter for a value nobody charts (a
        # process-wide switch in prometheus_client; the daemon is the only exporter).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.training = TrainingMetrics(
            self.registry, retention_seconds=settings.metrics.series_retention_seconds)
        # Since this daemon started: its runs' productive time, and the time none ran.
        self.node_goodput = NodeGoodput(started=time.time())
        self.daemon_metrics = DaemonMetrics(
            self.registry, version=__version__, torch_version=torch_build().version,
            hub_dropped=lambda: self.hub.dropped, subscribers=lambda: self.hub.subscribers,
            db_pending=lambda: self.events.pending, node_goodput=self.node_goodput)
        host = HostCollector(lambda: self.supervisor.worker_pids(), usable_cpus=usable_cpus)
        self.registry.register(host)
        self.registry.register(SchedulerCollector(
            lambda: queue.experiments_by_state(self.engine),
            lambda: queue.queue_depth(self.engine),
            lambda: queue.lease_expiries(self.engine)))
        self.gpu = (GpuCollector(per_link=settings.metrics.per_link) if settings.metrics.gpu
                    else None)  # NVML only: the daemon never initialises CUDA
        if self.gpu is not None:
            self.registry.register(self.gpu)
        # The Hardware page's last hour, sampled from the same collectors /metrics reads.
        gpu = self.gpu
        self.hardware = HardwareHistory(
            [host] if gpu is None else [host, gpu], gpu_enabled=gpu is not None,
            gpu_absent=lambda: None if gpu is None else gpu.absent_reason)
        # The daemon process as every Python exporter shows it (process_*, python_gc_*).
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        # Each run's step and layer series, sealed into the event buffer once a flush, ahead
        # of its write (daemon/ingest/series.py).
        self.series = SeriesRecorder(lambda run: self.supervisor.tokens_per_second(run),
                                     lambda run: self.supervisor.world_size(run))
        self.flusher = Flusher([lambda: self.series.seal(self.events),
                                lambda: self.events.flush(self._write_events)],
                               pending=lambda: self.events.pending)
        self.router = Router(lead=lambda run_id, rank: self.supervisor.lead(run_id, rank))
        self.supervisor = Supervisor(
            settings=settings, engine=self.engine, var_dir=self.var_dir,
            node_name=settings.daemon.node_addr or socket.gethostname(), tracer=self.tracer,
            metrics=self.daemon_metrics, hub=self.hub, on_event=self.router.route,
            flush=self.flusher.flush)
        # Before the summaries' write, so the check rides with it (RunSummary.note_host).
        self.flusher.add(lambda: self.supervisor.check_host(read_runnable, usable_cpus))
        self.flusher.add(self.supervisor.flush_summaries)
        self.guard = Guard(self.engine, self.supervisor.out_dir)
        # The order matters: the summary folds an event before the hub reads its figures.
        self.router.add(self._count)
        self.router.add(self.training.observe)
        self.router.add(self.supervisor.fold)
        self.supervisor.goodput_listeners.append(self.training.goodput)
        self.supervisor.goodput_listeners.append(self.node_goodput.run_progress)
        self.supervisor.straggler_listeners.append(self.training.straggler)
        self.router.add(self.tracer.observe)  # filters ranks itself
        self.router.add(self.guard.observe)  # so does the promotions' guard
        self.comm = CommHistory()  # every rank's comm and probe events, over time
        self.router.add(self.comm)
        self.router.add(self.supervisor.deliver, lead_only=True)  # handles: trials, A/B blocks
        self.hub_feed = HubFeed(self.hub, self.supervisor.tokens_per_second,
                                self.supervisor.goodput)
        self.router.add(self.hub_feed, lead_only=True)
        self.router.add(store_feed(self.events), lead_only=True)
        self.router.add(self.series, lead_only=True)
        self.router.add(self.series.every_rank)  # a multi-rank run's per-rank lines
        self.profiles = Profiles()  # profiles on demand: every rank's traces
        self.router.add(self.profiles.observe)
        self.supervisor.launching.append(self._follow)
        ends = Ends()
        # One pool for every experiment job this node starts, whatever its mode.
        self.slots = Slots(settings.daemon.max_experiment_jobs)
        self.interleaved = InterleavedRunner(settings=settings, engine=self.engine,
                                             runs=self.supervisor, slots=self.slots,
                                             on_end=ends.notify)
        self.flusher.add(self.interleaved.flush)
        self.forked = ForkedRunner(engine=self.engine, var_dir=self.var_dir, runs=self.supervisor,
                                   slots=self.slots, on_end=ends.notify)
        self.experiment_service = Experiments(
            settings=settings, engine=self.engine, runs=self.supervisor,
            interleaved=self.interleaved, forked=self.forked, ends=ends)
        # What the web layer calls (NodeService), each call handed to its owner.
        self.service = Facade(engine=self.engine, registry=self.registry,
                              daemon_metrics=self.daemon_metrics, hub=self.hub,
                              supervisor=self.supervisor, experiments=self.experiment_service,
                              token=self.token, ready=lambda: self._ready,
                              comm=self.comm, hardware=self.hardware,
                              profiles=self.profiles)
        self.tuner = AutoTuner(settings=settings, engine=self.engine, runs=self.supervisor,
                               experiments=self.experiment_service,
                               promote=self.service.promote)
        self.service.tuner = self.tuner
        self.cluster = (SlotRunner(engine=self.engine, settings=settings, runs=self.supervisor,
                                   slots=self.slots)
                        if settings.daemon.cluster else None)
        self._ready = False

    def _follow(self, handle: RunHandle, _cfg: TrainConfig) -> None:
        """Once a run's end is recorded, what the node keeps per run lets go of it: its
        series leave /metrics, and its summary and live points memory, a retention
        (``metrics.series_retention_seconds``) later; the DB keeps its history. Nothing a
        long-lived daemon holds grows with the runs it has trained."""
        run_id = handle.id
        self.node_goodput.run_started(run_id, time.time())

        def forget() -> None:
            self.supervisor.forget(run_id)
            self.hub.forget(run_id)
            self.hub_feed.forget(run_id)
            self.comm.forget(run_id)

        def ended(_: object) -> None:
            self.node_goodput.run_ended(run_id, time.time())
            self.profiles.ended(run_id)
            self.training.finished(run_id)
            self.guard.forget(run_id)
            asyncio.get_running_loop().call_later(
                self.settings.metrics.series_retention_seconds, forget)

        handle.ended.add_done_callback(ended)

    def _count(self, _run_id: int, event: Event) -> None:
        self.daemon_metrics.events.labels(event.kind).inc()

    def _write_events(self, run_id: int, events: list[dict[str, Any]]) -> None:
        crud.add_events(self.engine, run_id=run_id, events=events)

    # -- lifecycle ---------------------------------------------------------------------------

    def migrate(self) -> None:
        upgrade(self.db_url)
        recovery.recover_interrupted(self.engine, node=self.supervisor.node_name)
        if n := crud.mark_interrupted(self.engine, resumable=has_checkpoint,
                                      node=self.supervisor.node_name):
            log.info("%d runs of a previous daemon ended with it (preempted if resumable)", n)
        if ids := self.interleaved.requeue_stranded(self.supervisor.node_name):
            log.warning("interleaved experiments %s are queued again: their daemon stopped "
                        "before their runs saved a checkpoint", ", ".join(map(str, ids)))

    async def serve(self) -> None:
        """Migrate, start the web server and the default job; on shutdown stop every job."""
        from traind.web.app import create_app  # daemon -> web; web never imports the node
        from traind.web.sessions import Sessions

        await asyncio.to_thread(self.migrate)
        d = self.settings.daemon
        sessions = Sessions()
        write_login_link(self.var_dir, d.host, d.port, sessions.login_code())
        server = _Server(uvicorn.Config(
            create_app(self.service, allowed_hosts=[d.host, *d.allowed_hosts],
                       sessions=sessions, open_pages=d.open_pages), host=d.host,
            port=d.port, log_level="warning",
            access_log=False, ws="websockets-sansio", lifespan="on",
            # A page that stops reading is let go once a ping goes unanswered: its kernel and
            # transport buffers (megabytes on loopback) would otherwise be held for as long as
            # it stays connected. The hub's bounded queue covers the time until then.
            ws_ping_interval=d.ws_ping_seconds, ws_ping_timeout=d.ws_ping_seconds))
        flusher = asyncio.create_task(self.flusher.forever())
        sampler = asyncio.create_task(self.hardware.forever())
        notifier = Notifier.from_env()  # before any job: children must not inherit it
        systemd = asyncio.create_task(notifier.run(
            started=lambda: server.started, alive=self.flusher.alive,
            status=f"serving on {d.host}:{d.port}"))
        loop = asyncio.get_running_loop()

        def stop(sig: signal.Signals) -> None:
            # From the signal on, nothing new starts: the server may take a while to close
            # its connections, and a runner would launch its next trial meanwhile.
            self.supervisor.stopping = True
            server.handle_exit(sig, None)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        try:
            # Forked experiments a previous daemon left unfinished carry on (their trials'
            # leases run out and are claimed again).
            for exp_id in await asyncio.to_thread(self.experiment_service.unfinished_forked):
                self.forked.start(exp_id)
            for tune_id in await asyncio.to_thread(self.tuner.unfinished):
                self.tuner.start(tune_id)
            if self.cluster is not None:
                self.cluster.start()
            resumed = await self.supervisor.resume_preempted()
            await self.interleaved.resume_preempted()  # before the queue: they hold trials
            await self.interleaved.start_queued()  # those a previous daemon left queued
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
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await asyncio.to_thread(self.flusher.flush)
            if self.tracer_provider is not None:
                await asyncio.to_thread(self.tracer_provider.shutdown)  # flushes the batch
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            systemd.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await systemd
            notifier.close()

    async def shutdown(self) -> None:
        self.supervisor.stopping = True  # jobs that checkpoint on the way out end "preempted"
        self.slots.close()  # whatever waits for a slot stays queued for the next start
        await self.tuner.close()  # first: it would submit its next round meanwhile
        if self.cluster is not None:
            await self.cluster.close()
        await self.forked.close()  # first: a runner would launch its next trial meanwhile
        await self.supervisor.close()
        await self.profiles.idle()  # reports being built from the last traces
        if self.interleaved.tasks:  # their experiments end once their runs have
            await asyncio.wait(set(self.interleaved.tasks), timeout=60)
        self.tracer.close()  # ends the spans of runs whose exit was never seen
        if self.gpu is not None:
            self.gpu.close()

    async def submit(self, cfg: TrainConfig) -> int:
        """Record a run, launch its workers and supervise them (runs/supervisor.py). Returns
        the run id."""
        return (await self.supervisor.submit(cfg)).id
