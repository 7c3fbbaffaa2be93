"""The daemon as the web layer sees it: ``NodeService`` (daemon/service.py), each call handed
to the part that owns it. Nothing is decided here; ``node.py`` builds it with the parts.

The blocking calls (database reads) are the caller's to run in a thread pool, as the protocol
says; the async ones keep their database work off the event loop themselves.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import choose_encoder

from traind import __version__
from traind.daemon.auth import token_matches
from traind.daemon.db import crud, queue
from traind.daemon.db.promotions import list_promotions
from traind.daemon.devices import read_devices
from traind.daemon.experiments.specs import refuse_paths
from traind.daemon.ingest.messages import finite_or_none
from traind.daemon.ingest.series import STEPS
from traind.daemon.profiles.captures import capture_numbers, read_report, trace_file
from traind.daemon.promotions import hand_over
from traind.daemon.provenance import Provenance, node_versions
from traind.daemon.runs import series
from traind.daemon.runs.jobs import log_tail
from traind.daemon.runs.series_page import series_page
from traind.daemon.service import (
    PAGE,
    AutotuneInfo,
    AutotuneSpec,
    Capture,
    ExperimentEvidence,
    ExperimentInfo,
    ExperimentSpec,
    MetricSample,
    PromotionView,
    QueuedTrial,
    RunDetail,
    RunQuery,
    RunView,
)

# The run events a run's page lists (its evaluations and series are drawn, not listed).
PAGE_EVENTS = ("started", "checkpoint", "resumed", "promoted", "compile_fallback", "finished",
               "numerics")

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable, Sequence
    from contextlib import AbstractAsyncContextManager

    from prometheus_client import CollectorRegistry
    from sqlalchemy import Engine

    from traind.daemon.autotune.runner import AutoTuner
    from traind.daemon.experiments.service import Experiments
    from traind.daemon.ingest.comm_history import CommHistory
    from traind.daemon.ingest.hardware_history import HardwareHistory
    from traind.daemon.ingest.hub import EventHub
    from traind.daemon.profiles.captures import Profiles
    from traind.daemon.runs.supervisor import Supervisor
    from traind.metrics.daemon import DaemonMetrics


class Facade:
    """``NodeService`` by delegation. ``ready``: whether the node serves (for /healthz)."""

    def __init__(self, *, engine: Engine, registry: CollectorRegistry,
                 daemon_metrics: DaemonMetrics, hub: EventHub, supervisor: Supervisor,
                 experiments: Experiments, token: str, ready: Callable[[], bool],
                 comm: CommHistory, hardware: HardwareHistory, profiles: Profiles) -> None:
        self.engine, self.registry, self.daemon_metrics = engine, registry, daemon_metrics
        self.hub, self.supervisor, self.experiment_service = hub, supervisor, experiments
        self.comm, self.hardware, self.profile_captures = comm, hardware, profiles
        self.tuner: AutoTuner | None = None  # the node sets it: the tuner promotes through us
        self._token, self._ready = token, ready

    # -- runs and live data --------------------------------------------------------------------

    def runs(self, *, limit: int = PAGE, offset: int = 0, query: RunQuery | None = None
             ) -> list[RunView]:
        return crud.list_runs(self.engine, limit=limit, offset=offset, query=query)

    def count_runs(self, query: RunQuery | None = None) -> int:
        return crud.count_runs(self.engine, query=query)

    def live_snapshot(self, run: int | None = None) -> dict[str, Any]:
        return self.hub.snapshot(run)

    def run_detail(self, run_id: int) -> RunDetail | None:
        view = crud.get_run(self.engine, run_id=run_id)
        record = crud.run_record(self.engine, run_id=run_id)
        if view is None or record is None:
            return None
        events = crud.run_events(self.engine, run_id=run_id, kinds=PAGE_EVENTS)
        return RunDetail(
            run=view, kind=record["kind"], node=record["node"], config=record["config"],
            events=[{"kind": e["kind"], "step": e["step"], "time": e["time"],
                     "data": e["data"]} for e in events],
            experiments=crud.run_experiments(self.engine, run_id=run_id),
            log_tail=log_tail(record["out_dir"]), running_here=self.supervisor.running(run_id))

    def run_series(self, run_id: int, *, points: int, ranks: bool = False,
                   comm: bool = False, after: int | None = None) -> dict[str, Any] | None:
        if crud.get_run(self.engine, run_id=run_id) is None:
            return None

        def chunks(kind: str, newest_first: bool) -> Iterable[dict[str, Any]]:
            if newest_first:  # a whole page: streamed, one chunk held at a time
                return crud.stream_chunks(self.engine, run_id=run_id, kind=kind)
            # A tail's reports start at ``after`` (its steps after it); the chunks that may
            # hold them are the newest few.
            return crud.run_chunks(self.engine, run_id=run_id, kind=kind, since=after)

        evals = crud.run_events(self.engine, run_id=run_id, kind="eval", since=after)
        switches = crud.run_events(self.engine, run_id=run_id, kind="precision", since=after)
        return series_page(
            run_id, chunks, lambda kind: crud.first_step(self.engine, run_id=run_id, kind=kind),
            evals=[(e["step"], finite_or_none(e["value"])) for e in evals],
            precision=[{"step": e["step"], **e["data"], "snr": finite_or_none(e["value"])}
                       for e in switches],
            points=points, ranks=ranks, comm=comm, after=after)

    def run_export(self, run_id: int) -> list[list[Any]] | None:
        if (steps := self._steps(run_id)) is None:
            return None
        evals = [(e["step"], e["value"])
                 for e in crud.run_events(self.engine, run_id=run_id, kind="eval")]
        return list(series.csv_rows(steps, evals))

    def _steps(self, run_id: int) -> dict[str, list[Any]] | None:
        """The run's stored steps, merged (None for no such run): the page's and the export's."""
        if crud.get_run(self.engine, run_id=run_id) is None:
            return None
        return series.merge_steps(crud.run_chunks(self.engine, run_id=run_id, kind=STEPS))

    async def stop_run(self, run_id: int) -> bool:
        return self.supervisor.request_stop(run_id)

    async def probe_links(self, run_id: int) -> bool:
        return self.supervisor.request_link_probe(run_id)  # a file touched: no thread needed

    async def request_profile(self, run_id: int, *, steps: int,
                              ranks: list[int] | None = None) -> Capture | None:
        if (out_dir := self.supervisor.out_dir(run_id)) is None:
            return None
        # files written, nothing waited for: on the loop, as probe_links
        return self.profile_captures.ask(run_id, Path(out_dir), steps=steps, ranks=ranks)

    def _run_folder(self, run_id: int) -> Path | None:
        record = crud.run_record(self.engine, run_id=run_id)
        return Path(record["out_dir"]) if record is not None and record["out_dir"] else None

    def profiles(self, run_id: int) -> list[Capture] | None:
        if crud.get_run(self.engine, run_id=run_id) is None:
            return None
        out_dir = self._run_folder(run_id)
        return (self.profile_captures.captures(run_id, out_dir,
                                               running=self.supervisor.running(run_id))
                if out_dir is not None else [])

    def profile(self, run_id: int, capture: int
                ) -> tuple[Capture, dict[str, Any] | None] | None:
        out_dir = self._run_folder(run_id)
        if out_dir is None or capture not in capture_numbers(out_dir):
            return None
        found = self.profile_captures.capture(run_id, out_dir, capture,
                                              running=self.supervisor.running(run_id))
        return found, read_report(out_dir, capture)

    def profile_trace(self, run_id: int, capture: int, rank: int) -> Path | None:
        out_dir = self._run_folder(run_id)
        return trace_file(out_dir, capture, rank) if out_dir is not None else None

    def subscribe(self) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        return self.hub.subscribe()

    def comm_history(self, run: int | None = None) -> dict[str, Any]:
        return self.comm.snapshot(run)

    def hardware_history(self) -> dict[str, Any]:
        return self.hardware.snapshot()

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

    # -- experiments ---------------------------------------------------------------------------

    async def submit_experiment(self, spec: ExperimentSpec) -> ExperimentInfo:
        return await self.experiment_service.submit_experiment(spec)

    def experiments(self, *, limit: int = PAGE, offset: int = 0) -> list[ExperimentInfo]:
        return self.experiment_service.experiments(limit=limit, offset=offset)

    def experiment(self, experiment_id: int) -> ExperimentInfo | None:
        return self.experiment_service.experiment(experiment_id)

    def experiment_evidence(self, experiment_id: int) -> ExperimentEvidence | None:
        return self.experiment_service.experiment_evidence(experiment_id)

    async def cancel_experiment(self, experiment_id: int) -> bool:
        return await self.experiment_service.cancel_experiment(experiment_id)

    def queued_trials(self, *, limit: int = PAGE, offset: int = 0) -> list[QueuedTrial]:
        return [QueuedTrial(t.id, t.experiment_id, name, t.arm_name, t.repeat, t.priority)
                for t, name in queue.waiting_trials(self.engine, limit=limit, offset=offset)]

    def reorder_trials(self, trial_ids: list[int]) -> None:
        queue.reorder(self.engine, trial_ids_in_order=trial_ids)

    # -- auto-tuning and promotions ------------------------------------------------------------

    def _tuner(self) -> AutoTuner:
        assert self.tuner is not None, "node.py sets the tuner before serving"
        return self.tuner

    async def submit_autotune(self, spec: AutotuneSpec) -> AutotuneInfo:
        # Up front, so the error names overrides.<path> rather than each round's candidate.
        refuse_paths(spec.overrides)
        for i, c in enumerate(spec.compressions):
            refuse_paths({"compression": c}, where=("compressions", i))
        return await self._tuner().submit(spec)

    def autotunes(self, *, limit: int = PAGE, offset: int = 0) -> list[AutotuneInfo]:
        return self._tuner().list(limit=limit, offset=offset)

    def autotune(self, tune_id: int) -> AutotuneInfo | None:
        return self._tuner().get(tune_id)

    async def cancel_autotune(self, tune_id: int) -> bool:
        return await self._tuner().cancel(tune_id)

    def promotions(self, run_id: int | None = None, *, limit: int = PAGE, offset: int = 0
                   ) -> list[PromotionView]:
        return list_promotions(self.engine, run_id=run_id, limit=limit, offset=offset)

    async def promote(self, run_id: int, setting: dict[str, Any], *,
                      evidence: dict[str, Any], autotune_id: int | None = None,
                      experiment_ids: Sequence[int] = (), baseline: bool = False
                      ) -> int | None:
        """Hand ``setting`` to run ``run_id`` at its next checkpoint boundary, on the
        strength of ``evidence`` (``experiment_ids``: the experiments that measured it, whose
        configuration must be the run's). None: nothing was sent (``baseline``: nothing beat
        the search's baseline; the run already trains with it; it is not running here).
        Raises ``ConfigError`` naming each field in which the evidence's configuration differs
        from the run's (``daemon/promotions.hand_over``; the refusal is recorded too)."""
        out_dir = self.supervisor.out_dir(run_id)
        config = await asyncio.to_thread(crud.run_config, self.engine, run_id=run_id)
        if out_dir is None or config is None:
            return None

        def checked() -> int | None:
            versions = node_versions(read_devices().kind)  # NVML: no CUDA in the daemon
            found = [queue.get_experiment(self.engine, experiment_id=i) for i in experiment_ids]
            return hand_over(
                self.engine, run_id=run_id, out_dir=out_dir, config=config, setting=setting,
                evidence=evidence, autotune_id=autotune_id, baseline=baseline,
                target=Provenance.of(f"run {run_id}", config, versions),
                evidence_from=[Provenance.of(f"experiment {e.id}", e.base_config, e.versions)
                               for e in found if e is not None])

        return await asyncio.to_thread(checked)

    # -- the node ------------------------------------------------------------------------------

    def check_token(self, token: str | None) -> bool:
        return token_matches(self._token, token)

    def health(self) -> dict[str, Any]:
        return {"ok": self._ready(), "version": __version__,
                "runs_running": len(self.supervisor.jobs)}
