"""Web test helpers: a fake node service around a real EventHub, a live uvicorn server, and
Debian's chromium for Playwright.

Tests reach everything through fixtures, not imports: tests/ has no ``__init__.py``, and
fixtures work the same under every pytest import mode.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import threading
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import uvicorn

from traind.contracts.comm import LATENCY_BOUNDS, latency_bin
from traind.contracts.events import CommEvent, ProbeEvent
from traind.daemon.autotune.search import Candidate
from traind.daemon.experiments import evidence
from traind.daemon.ingest.comm_history import SLOT_SECONDS, CommHistory
from traind.daemon.ingest.hardware_history import HardwareHistory, pick
from traind.daemon.ingest.hub import EventHub
from traind.daemon.ingest.series import COMM, LAYERS, RANK_STEPS, STEPS, SeriesRecorder
from traind.daemon.runs import series
from traind.daemon.runs.series_page import series_page
from traind.daemon.service import (
    AutotuneInfo,
    AutotuneSpec,
    Capture,
    ExperimentEvidence,
    ExperimentInfo,
    ExperimentSpec,
    Measurement,
    MetricSample,
    ProfileRefused,
    PromotionView,
    QueuedTrial,
    RunDetail,
    RunQuery,
    RunView,
)
from traind.errors import FieldErrors

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

TOKEN = "test-token-0123456789"
SUMMARY_SORT = ("step", "loss", "val_loss", "tokens_per_second")

# Recent, so the running run's duration in the screenshots looks like a real one.
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=12)


def _config_holds(config: dict[str, Any], key: tuple[str, ...], value: str) -> bool:
    """The database's config match (daemon/db/json_match.py), near enough for the fake: a
    string equal to ``value``, or a number, boolean or null that ``value`` reads as."""
    for part in key:
        if not isinstance(config, dict) or part not in config:
            return False
        config = config[part]
    if isinstance(config, str):
        return config == value
    try:
        return not isinstance(config, dict | list) and json.loads(value) == config
    except ValueError:
        return False


def _database_int(value: int | None) -> None:
    """What SQLite does with an integer past its 64 bits, so a route that passes one on
    fails here as it would on the daemon's database (a 500), not silently."""
    if value is not None and not -2**63 <= value < 2**63:
        raise OverflowError("Python int too large to convert to SQLite INTEGER")


@dataclass
class FakeService:
    """Implements traind.daemon.service.NodeService with canned runs and a real hub."""

    run_views: list[RunView] = field(default_factory=list)
    healthy: bool = True
    hub: EventHub = field(default_factory=EventHub)
    accepts: list[str | None] = field(default_factory=list)
    metric_samples: list[MetricSample] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)  # what samples() was asked for
    token: str = TOKEN
    experiment_infos: dict[int, ExperimentInfo] = field(default_factory=dict)
    specs: list[ExperimentSpec] = field(default_factory=list)  # what was accepted, in order
    # What submit_experiment raises: a ValueError (a ConfigError names fields), or a message
    # for a plain one.
    reject: ValueError | str | None = None
    autotune_infos: dict[int, AutotuneInfo] = field(default_factory=dict)
    tune_specs: list[AutotuneSpec] = field(default_factory=list)  # accepted, in order
    tune_reject: ValueError | str | None = None  # the same for submit_autotune
    promotion_views: list[PromotionView] = field(default_factory=list)  # newest first
    trials: list[QueuedTrial] = field(default_factory=list)  # waiting, in claim order
    # A run's stored step columns (daemon/ingest/series.py); missing: synthetic_columns.
    step_columns: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    run_experiments: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    switches: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # precision
    # A run's stored comm chunks (daemon/ingest/series.py COMM): synthetic_comm_chunks.
    comm_chunks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)  # what stop_run was asked to stop
    probed: list[int] = field(default_factory=list)  # what probe_links was asked to probe
    configs: dict[int, dict[str, Any]] = field(default_factory=dict)  # a run's, if not the default
    # An experiment's blocks or trials (summarised by the real daemon/experiments/evidence.py)
    # and its budget, if not 1,200 steps in blocks of 20.
    measurements: dict[int, list[Measurement]] = field(default_factory=dict)
    budgets: dict[int, dict[str, Any]] = field(default_factory=dict)
    # The daemon's own buffers, empty unless a test (or the service fixture) fills them.
    comm: CommHistory = field(default_factory=CommHistory)
    hardware: HardwareHistory = field(default_factory=lambda: HardwareHistory(
        [], gpu_enabled=True, gpu_absent=lambda: "NVML Shared Library Not Found"))
    # A run's profile captures, oldest first, each with its report (None until built), and
    # the trace files a download may serve.
    captures: dict[int, list[tuple[Capture, dict[str, Any] | None]]] = field(
        default_factory=dict)
    trace_files: dict[tuple[int, int, int], Path] = field(default_factory=dict)

    def _matching(self, query: RunQuery | None) -> list[RunView]:
        q = query or RunQuery()
        found = [r for r in self.run_views
                 if (not q.state or r.state == q.state)
                 and (not q.name or q.name.lower() in r.name.lower())
                 and (q.experiment is None or r.id in self._experiment_runs(q.experiment))
                 and (q.config is None or _config_holds(self.config_of(r), q.config.key,
                                                        q.config.value))]

        def key(r: RunView) -> Any:
            v = r.summary.get(q.sort) if q.sort in SUMMARY_SORT else getattr(r, q.sort)
            return v.lower() if q.sort == "name" else v

        have = [r for r in found if key(r) is not None]
        # As the database sorts: by the key (ties newest first), runs without it last.
        have.sort(key=lambda r: -r.id)
        have.sort(key=key, reverse=q.descending)
        return have + sorted((r for r in found if key(r) is None), key=lambda r: -r.id)

    def _experiment_runs(self, experiment_id: int) -> set[int]:
        info = self.experiment_infos.get(experiment_id)
        return set() if info is None else {info.run_id, *info.trial_runs} - {None}

    def config_of(self, run: RunView) -> dict[str, Any]:
        return self.configs.get(run.id) or {"job": {"steps": 5000, "name": run.name},
                                            "precision": {"mode": "bf16"}}

    def runs(self, *, limit: int = 50, offset: int = 0, query: RunQuery | None = None
             ) -> list[RunView]:
        return self._matching(query)[offset:offset + limit]

    def count_runs(self, query: RunQuery | None = None) -> int:
        return len(self._matching(query))

    def live_snapshot(self, run: int | None = None) -> dict[str, Any]:
        return self.hub.snapshot(run)

    def _view(self, run_id: int) -> RunView | None:
        _database_int(run_id)
        return next((r for r in self.run_views if r.id == run_id), None)

    def run_detail(self, run_id: int) -> RunDetail | None:
        run = self._view(run_id)
        if run is None:
            return None
        events = [{"kind": "started", "step": 0, "time": run.started_at, "data": {"ranks": 2}},
                  {"kind": "checkpoint", "step": 1000, "time": run.started_at,
                   "data": {"path": f"/var/traind/runs/{run_id}/step_00001000.pt",
                            "seconds": 0.42, "sharded": False}},
                  {"kind": "numerics", "step": 1100, "time": run.started_at,
                   "data": {"action": "skip_step", "reason": "nonfinite_grad"}}]
        return RunDetail(run=run, kind="job", node="node-a",
                         config=self.config_of(run),
                         events=events, experiments=self.run_experiments.get(run_id, []),
                         log_tail="rank 0: step 1200\n", running_here=run.state == "running")

    def run_series(self, run_id: int, *, points: int, ranks: bool = False,
                   comm: bool = False, after: int | None = None) -> dict[str, Any] | None:
        run = self._view(run_id)
        if run is None:
            return None
        _database_int(after)
        cols = self.step_columns.get(run_id) or synthetic_columns(run)
        n = len(cols["step"])
        evals = [s for s in cols["step"] if s % 500 == 0]
        layer_chunks = [{"layers": ["embed", "block.0", "block.1", "head"],
                         "step": cols["step"][::50],
                         "grad_norm": [[0.1 * (j + 1) * (1 + 1 / (1 + s / 100))
                                        for j in range(4)] for s in cols["step"][::50]],
                         "update_ratio": [[1e-3 / (j + 1) for j in range(4)]
                                          for _ in cols["step"][::50]]}]
        world = run.summary.get("world_size", 1)
        # A tail reads only the newest parts, as the daemon's query does (crud.run_chunks).
        rank_cols = cols if after is None else {
            k: v[bisect.bisect_left(cols["step"], after):] for k, v in cols.items()}
        stored = {
            STEPS: [cols] if n else [],
            LAYERS: layer_chunks if n else [],
            RANK_STEPS: synthetic_rank_chunks(rank_cols, world) if world > 1 else [],
            COMM: [c for c in self.comm_chunks.get(run_id, [])
                   if after is None or max(c["reports"]["step"]) >= after]}

        def chunks(kind: str, newest_first: bool) -> list[dict[str, Any]]:
            return stored[kind][::-1] if newest_first else stored[kind]

        def first_step(kind: str) -> int | None:
            steps = [s for c in stored[kind]
                     for s in (c["reports"]["step"] if kind == COMM else c["step"])]
            return min(steps, default=None)

        # The page's shape from the daemon's own pure function (daemon/runs/series_page.py).
        return series_page(
            run_id, chunks, first_step,
            evals=[(s, 3.0 + 1 / (1 + s / 1000)) for s in evals],
            precision=self.switches.get(run_id, []), points=points, ranks=ranks, comm=comm,
            after=after)

    def run_export(self, run_id: int) -> list[list[Any]] | None:
        run = self._view(run_id)
        if run is None:
            return None
        return list(series.csv_rows(self.step_columns.get(run_id) or synthetic_columns(run),
                                    []))

    async def stop_run(self, run_id: int) -> bool:
        run = self._view(run_id)
        if run is None or run.state != "running":
            return False
        self.stopped.append(run_id)
        return True

    async def probe_links(self, run_id: int) -> bool:
        run = self._view(run_id)
        if run is None or run.state != "running":
            return False
        self.probed.append(run_id)
        return True

    async def request_profile(self, run_id: int, *, steps: int,
                              ranks: list[int] | None = None) -> Capture | None:
        run = self._view(run_id)
        if run is None or run.state != "running":
            return None
        world = int(run.summary.get("world_size", 1))
        if ranks and max(ranks) >= world:
            raise ProfileRefused.at(("ranks",), f"the job has ranks 0 to {world - 1}")
        held = self.captures.setdefault(run_id, [])
        if held and held[-1][0].state == "waiting":
            raise ProfileRefused(f"capture {held[-1][0].capture} of run {run_id} is still "
                                 "under way", conflict=True)
        c = Capture(run=run_id, capture=len(held) + 1, steps=steps,
                    ranks=tuple(ranks or range(world)), requested=1.7e9, state="waiting",
                    traces=())
        held.append((c, None))
        return c

    def profiles(self, run_id: int) -> list[Capture] | None:
        if self._view(run_id) is None:
            return None
        return [c for c, _ in reversed(self.captures.get(run_id, []))]

    def profile(self, run_id: int, capture: int
                ) -> tuple[Capture, dict[str, Any] | None] | None:
        return next(((c, body) for c, body in self.captures.get(run_id, [])
                     if c.capture == capture), None)

    def profile_trace(self, run_id: int, capture: int, rank: int) -> Path | None:
        return self.trace_files.get((run_id, capture, rank))

    def subscribe(self) -> AbstractAsyncContextManager[Any]:
        return self.hub.subscribe()

    def comm_history(self, run: int | None = None) -> dict[str, Any]:
        return self.comm.snapshot(run)

    def hardware_history(self) -> dict[str, Any]:
        return self.hardware.snapshot()

    def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        self.accepts.append(accept)
        body = b"# HELP traind_up Whether traind is up.\n# TYPE traind_up gauge\ntraind_up 1\n"
        return body, "text/plain; version=0.0.4; charset=utf-8"

    def samples(self, prefix: str) -> list[MetricSample]:
        self.prefixes.append(prefix)
        return [s for s in self.metric_samples if s.name.startswith(prefix)]

    def health(self) -> dict[str, Any]:
        return {"ok": self.healthy, "db": "ok" if self.healthy else "unreachable"}

    async def submit_experiment(self, spec: ExperimentSpec) -> ExperimentInfo:
        if self.reject is not None:
            raise _error(self.reject)
        self.specs.append(spec)
        eid = max(self.experiment_infos, default=0) + 1
        info = ExperimentInfo(
            id=eid, name=spec.name, state="queued", mode="interleaved",
            arms=tuple(a["name"] for a in spec.arms), run_id=100 + eid, verdict=None,
            config_hash=f"{eid:08x}", versions={"traind": "0.1.0", "torch": "2.13.0"},
            created_at=T0 + timedelta(minutes=eid), finished_at=None,
        )
        self.experiment_infos[eid] = info
        return info

    def experiments(self, *, limit: int = 50, offset: int = 0) -> list[ExperimentInfo]:
        return sorted(self.experiment_infos.values(), key=lambda e: e.id,
                      reverse=True)[offset:offset + limit]

    def experiment(self, experiment_id: int) -> ExperimentInfo | None:
        return self.experiment_infos.get(experiment_id)

    def experiment_evidence(self, experiment_id: int) -> ExperimentEvidence | None:
        info = self.experiment_infos.get(experiment_id)
        if info is None:
            return None
        return evidence.summarise(
            mode=info.mode, arms=info.arms, measurements=self.measurements.get(experiment_id, []),
            budget=self.budgets.get(experiment_id, {"steps": 1200, "block_steps": 20}),
            verdict=info.verdict)

    async def cancel_experiment(self, experiment_id: int) -> bool:
        info = self.experiment_infos[experiment_id]
        if info.state in ("done", "cancelled", "failed"):
            return False
        self.experiment_infos[experiment_id] = replace(
            info, state="cancelled", finished_at=T0 + timedelta(hours=1))
        return True

    async def submit_autotune(self, spec: AutotuneSpec) -> AutotuneInfo:
        """Like the daemon: fp16 and fp8 are left out with a reason, and the first round
        (the precisions against fp32) is in flight."""
        if self.tune_reject is not None:
            raise _error(self.tune_reject)
        self.tune_specs.append(spec)
        tid = max(self.autotune_infos, default=0) + 1
        none = {"method": "none"}
        left = [{"candidate": f"{p}.none", "reason": f"{p} cannot switch inside a running job"}
                for p in spec.precisions if p in ("fp16", "fp8")]
        challengers = [Candidate(p, none).as_dict() for p in spec.precisions if p == "bf16"]
        rounds = [{"stage": "precision", "index": 0, "steps": spec.steps,
                   "baseline": Candidate("fp32", none).as_dict(),
                   "challengers": challengers, "experiment_id": 40 + tid, "verdicts": None}]
        info = AutotuneInfo(
            id=tid, name=spec.name, state="running",
            best={"precision": "fp32", "compression": none, "bucket_mb": None},
            infeasible=left, rounds=rounds if challengers else [], error=None,
            target_run_id=spec.target_run_id, config_hash=f"{tid:08x}",
            versions={"traind": "0.1.0", "torch": "2.13.0", "device": "cpu"},
            created_at=T0 + timedelta(minutes=tid), finished_at=None)
        self.autotune_infos[tid] = info
        return info

    def autotunes(self, *, limit: int = 50, offset: int = 0) -> list[AutotuneInfo]:
        return sorted(self.autotune_infos.values(), key=lambda t: t.id,
                      reverse=True)[offset:offset + limit]

    def autotune(self, tune_id: int) -> AutotuneInfo | None:
        return self.autotune_infos.get(tune_id)

    async def cancel_autotune(self, tune_id: int) -> bool:
        info = self.autotune_infos[tune_id]
        if info.state != "running":
            return False
        self.autotune_infos[tune_id] = replace(info, state="cancelled",
                                               finished_at=T0 + timedelta(hours=1))
        return True

    def promotions(self, run_id: int | None = None, *, limit: int = 50, offset: int = 0
                   ) -> list[PromotionView]:
        return [p for p in self.promotion_views
                if run_id is None or p.run_id == run_id][offset:offset + limit]

    def queued_trials(self, *, limit: int = 50, offset: int = 0) -> list[QueuedTrial]:
        return list(self.trials)[offset:offset + limit]

    def reorder_trials(self, trial_ids: list[int]) -> None:
        """As daemon.db.queue.reorder: the named trials swap the slots they hold; an id that is
        not waiting changes nothing."""
        if len(set(trial_ids)) != len(trial_ids):
            raise FieldErrors.at(("trial_ids_in_order",), "an id appears twice")
        slots = {t.id: i for i, t in enumerate(self.trials)}
        missing = [i for i in trial_ids if i not in slots]
        if missing:
            raise FieldErrors.at(("trial_ids_in_order",), f"not waiting trials: {missing}")
        order = list(self.trials)
        by_id = {t.id: t for t in self.trials}
        for trial_id, slot in zip(trial_ids, sorted(slots[i] for i in trial_ids), strict=True):
            order[slot] = by_id[trial_id]
        self.trials = order

    def check_token(self, token: str | None) -> bool:
        return token is not None and token == self.token

    def finish(self, experiment_id: int, verdict: dict[str, Any]) -> ExperimentInfo:
        """Mark an experiment done with ``verdict``, as the daemon would at the end."""
        info = replace(self.experiment_infos[experiment_id], state="done", verdict=verdict,
                       finished_at=T0 + timedelta(hours=1))
        self.experiment_infos[experiment_id] = info
        return info


def _error(reject: ValueError | str) -> ValueError:
    return ValueError(reject) if isinstance(reject, str) else reject


def synthetic_columns(run: RunView, steps: int | None = None) -> dict[str, list[Any]]:
    """A run's stored steps as the daemon keeps them: a falling, noisy loss up to its
    summary's step (one spike at step 700 that the min-max band must show)."""
    n = steps if steps is not None else int(run.summary.get("step", 0))
    t0 = run.started_at.timestamp() if run.started_at else 0.0
    xs = list(range(1, n + 1))
    loss = [3.0 + 4.0 / (1 + s / 300) + 0.05 * math.sin(s * 1.7) + (5.0 if s == 700 else 0)
            for s in xs]
    return {"step": xs, "time": [t0 + 0.1 * s for s in xs], "loss": loss,
            "lr": [1e-3 * min(1.0, s / 100) for s in xs],
            "grad_norm": [0.5 + 0.1 * math.cos(s / 10) for s in xs],
            "tokens_per_second": [50_000 + 500 * math.sin(s / 50) for s in xs],
            "step_seconds": [0.1 + 0.01 * math.sin(s) for s in xs],
            "data_seconds": [0.001] * n}


def synthetic_rank_chunks(cols: dict[str, list[Any]], ranks: int, slow: int = 1
                          ) -> list[dict[str, list[Any]]]:
    """A multi-rank run's per-rank rows (daemon/ingest/series.py RANK_STEPS), one per rank:
    rank ``slow`` a straggler, its forward pass 60% longer and the others waiting for it."""
    out = []
    for r in range(ranks):
        n = len(cols["step"])
        forward = [0.03 * (1.6 if r == slow else 1.0)] * n
        backward = [0.05 + (0.0 if r == slow else 0.018)] * n  # waiting in the all-reduce
        step_s = [v * (1.2 if r == slow else 1.0) for v in cols["step_seconds"]]
        out.append({"step": cols["step"], "rank": [r] * n,
                    "loss": [v + 0.02 * r for v in cols["loss"]],
                    "tokens_per_second": [64 / v for v in step_s], "step_seconds": step_s,
                    "data_seconds": cols["data_seconds"], "forward_seconds": forward,
                    "backward_seconds": backward, "optimizer_seconds": [0.01] * n})
    return out


def comm_event(step: int, rank: int, *, every: int = 10, world: int = 2,
               slow: float = 1.0) -> CommEvent:
    """A rank's report of ``every`` steps' gradient all-reduces (4 buckets of ~1 MiB a
    step, PowerSGD-compressed ~16x) and an all-gather; its latency ``slow`` x the usual."""
    calls, lat = 4 * every, 2e-4 * slow * (1 + 0.5 * math.sin(step / 500))
    counts = [0] * (len(LATENCY_BOUNDS) + 1)
    counts[latency_bin(lat)] = calls - 2
    counts[latency_bin(lat * 10)] += 2  # a tail the p99 shows
    gather = [0] * (len(LATENCY_BOUNDS) + 1)
    gather[latency_bin(5e-5)] = every
    raw = calls * 2**20
    return CommEvent(
        rank=rank, step=step, method="powersgd", steps=every, buckets=calls, raw_bytes=raw,
        sent_bytes=raw // 16, rel_error=0.05, hook_seconds=0.01,
        allreduce_seconds=lat * calls, world_size=world, time=100.0 + step,
        collectives=[{"op": "all_reduce", "size": "1MiB", "calls": calls, "bytes": raw // 16,
                      "seconds": lat * (calls + 18), "counts": counts},
                     {"op": "all_gather", "size": "4KiB", "calls": every,
                      "bytes": 1024 * every, "seconds": 5e-5 * every, "counts": gather}])


class _Chunks:
    """An EventBuffer's ``add`` and no more: where a recorder's sealed rows land in a test."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, run_id: int, event: dict[str, Any]) -> None:
        self.rows.append(event["data"])


def synthetic_comm_chunks(steps: Sequence[int], ranks: int = 2, *, every: int = 10,
                          per_chunk: int = 50) -> list[dict[str, Any]]:
    """A run's stored comm chunks as the real SeriesRecorder seals them: a report every
    ``every`` steps per rank (rank 1 ~30% slower), ``per_chunk`` reports a flush."""
    rec, out = SeriesRecorder(lambda run: 0.0, lambda run: ranks), _Chunks()
    for i, s in enumerate(x for x in steps if x % every == 0):
        for r in range(ranks):
            rec.every_rank(1, comm_event(s, r, every=every, world=ranks,
                                         slow=1.3 if r == 1 else 1.0))
        if (i + 1) % per_chunk == 0:
            rec.seal(out)  # type: ignore[arg-type]
    rec.seal(out)  # type: ignore[arg-type]
    return out.rows


def sample_runs() -> list[RunView]:
    """Newest first, one per state, with the failed one carrying log lines."""
    return [
        RunView(
            id=3,
            name="gpt-small-bf16",
            state="running",
            created_at=T0,
            started_at=T0 + timedelta(seconds=5),
            finished_at=None,
            exit_code=None,
            error=None,
            summary={"step": 1200, "loss": 3.21, "val_loss": 3.4, "tokens_per_second": 51234.5},
        ),
        RunView(
            id=2,
            name="gpt-small-fp8",
            state="failed",
            created_at=T0 - timedelta(hours=2),
            started_at=T0 - timedelta(hours=2),
            finished_at=T0 - timedelta(hours=1, minutes=58),
            exit_code=1,
            error="exit code 1: error\nTraceback (most recent call last):\nRuntimeError: <boom>",
            summary={"step": 40, "loss": 7.5},
        ),
        RunView(
            id=1,
            name="baseline",
            state="completed",
            created_at=T0 - timedelta(days=1),
            started_at=T0 - timedelta(days=1),
            finished_at=T0 - timedelta(hours=20),
            exit_code=0,
            error=None,
            summary={"step": 5000, "loss": 2.9, "val_loss": 3.0, "tokens_per_second": 48000},
        ),
    ]


GiB = 2**30


def host_samples() -> list[MetricSample]:
    """A 32-core host with a daemon and two workers, one disk and two interfaces."""
    m = MetricSample
    out = [
        m("traind_host_cpu_usage_ratio", {}, 0.634),
        m("traind_host_cpus", {}, 32),
        m("traind_host_memory_total_bytes", {}, 251.5 * GiB),
        m("traind_host_memory_used_bytes", {}, 96.2 * GiB),
        m("traind_host_memory_available_bytes", {}, 155.3 * GiB),
        m("traind_host_swap_total_bytes", {}, 8 * GiB),
        m("traind_host_swap_used_bytes", {}, 0.25 * GiB),
        *(
            m("traind_host_load", {"window": w}, v)
            for w, v in (("1m", 18.42), ("5m", 17.9), ("15m", 12.05))
        ),
        m("traind_host_disk_read_bytes_total", {"device": "nvme0n1"}, 1.9e12),
        m("traind_host_disk_written_bytes_total", {"device": "nvme0n1"}, 7.4e11),
        m("traind_host_disk_reads_total", {"device": "nvme0n1"}, 8_123_456),
        m("traind_host_disk_writes_total", {"device": "nvme0n1"}, 2_345_678),
    ]
    for nic, rx, tx, err in (("eth0", 3.1e12, 2.9e12, 2), ("lo", 5.5e9, 5.5e9, 0)):
        out += [
            m("traind_host_network_received_bytes_total", {"interface": nic}, rx),
            m("traind_host_network_sent_bytes_total", {"interface": nic}, tx),
            m("traind_host_network_errors_total", {"interface": nic, "direction": "receive"}, err),
            m("traind_host_network_errors_total", {"interface": nic, "direction": "transmit"}, 0),
        ]
    for role, pid, cpu, rss, threads, fds in (
        ("daemon", "4100", 312.5, 0.42 * GiB, 14, 61),
        ("worker", "4188", 5400.2, 9.8 * GiB, 48, 210),
        ("worker", "4189", 5391.7, 9.7 * GiB, 48, 208),
    ):
        lab = {"role": role, "pid": pid}
        out += [
            m("traind_process_cpu_seconds_total", lab, cpu),
            m("traind_process_resident_memory_bytes", lab, rss),
            m("traind_process_threads", lab, threads),
            m("traind_process_open_fds", lab, fds),
        ]
    return out


def gpu_samples(count: int) -> list[MetricSample]:
    """``count`` H100s; GPU 1 is held down by its power cap. ``count=0``: a node without."""
    m = MetricSample
    out = [m("traind_gpu_devices", {}, count), m("traind_gpu_collector_success", {}, 1)]
    reasons = ("gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown")
    for i in range(count):
        g = {"gpu": str(i)}
        capped = i == 1
        out += [
            m(
                "traind_gpu_info",
                {
                    **g,
                    "uuid": f"GPU-{i:04d}",
                    "name": "NVIDIA H100 80GB HBM3",
                    "pci_bus_id": f"0000:{i + 0x18:02X}:00.0",
                    "node": "n1",
                },
                1,
            ),
            m("traind_gpu_utilization_ratio", g, 0.97 if capped else 0.88),
            m("traind_gpu_memory_used_bytes", g, (76.1 if capped else 61.4) * GiB),
            m("traind_gpu_memory_total_bytes", g, 79.6 * GiB),
            m("traind_gpu_power_watts", g, 699.2 if capped else 612.7),
            m("traind_gpu_power_limit_watts", g, 700),
            m("traind_gpu_temperature_celsius", {**g, "sensor": "gpu"}, 71 if capped else 64),
            m("traind_gpu_temperature_celsius", {**g, "sensor": "memory"}, 78 if capped else 70),
            m("traind_gpu_clock_hertz", {**g, "clock": "sm"}, 1.755e9 if capped else 1.98e9),
            m("traind_gpu_clock_hertz", {**g, "clock": "memory"}, 2.619e9),
            m("traind_gpu_pcie_throughput_bytes_per_second", {**g, "direction": "tx"}, 1.3 * GiB),
            m("traind_gpu_pcie_throughput_bytes_per_second", {**g, "direction": "rx"}, 420 * 2**20),
            m("traind_gpu_pcie_link_generation", g, 5),
            m("traind_gpu_pcie_link_width", g, 16),
            m("traind_gpu_pcie_link_max_generation", g, 5),
            m("traind_gpu_pcie_link_max_width", g, 16),
            *(m("traind_gpu_nvlink_active_links", {**g, "link": str(k)}, 1) for k in range(18)),
            *(
                m(
                    "traind_gpu_throttle_reason",
                    {**g, "reason": r},
                    1 if capped and r == "sw_power_cap" else 0,
                )
                for r in reasons
            ),
        ]
    return out


PROBE_SIZES = [2**k for k in range(12, 27, 2)]  # 4 KiB .. 64 MiB


def comm_samples(run: str = "3") -> list[MetricSample]:
    """Two ranks of a PowerSGD run, rank 1 the straggler (it waits least), and a probe."""
    m = MetricSample
    out = []
    for rank, wait in (("0", 41.7), ("1", 12.3)):
        lab = {"run": run, "rank": rank, "method": "powersgd"}
        out += [
            m("traind_comm_gradient_bytes_total", lab, 412.5 * GiB),
            m("traind_comm_sent_bytes_total", lab, 6.4 * GiB),
            m("traind_comm_compression_ratio", lab, 64.4),
            m("traind_comm_compression_error_ratio", lab, 0.0871),
            m("traind_comm_hook_seconds_total", lab, 18.62),
            m("traind_comm_allreduce_seconds_total", lab, wait),
            m("traind_comm_buckets_total", lab, 96_000),
        ]
        for size in PROBE_SIZES:
            # Latency floor of ~20 µs, then bandwidth-bound at ~150 GB/s (bus bandwidth 2(n-1)/n).
            seconds = 20e-6 + size / 150e9 * (1.03 if rank == "1" else 1.0)
            p = {"run": run, "rank": rank, "op": "all_reduce", "size_bytes": str(size)}
            out += [
                m("traind_comm_probe_latency_seconds", p, seconds),
                m("traind_comm_probe_bus_bandwidth_bytes_per_second", p, size / seconds),
            ]
    return out


HISTORY_MINUTES = 30


def fill_comm_history(h: CommHistory, run: int = 3, *, probe: bool = True) -> None:
    """Half an hour of a 2-rank run's reports, one per slot per rank: all-reduce latencies
    that grow slowly (a noisy neighbour), a few all-gathers, and a probe a minute if
    ``probe``, bandwidth-bound at ~150 GB/s like comm_samples'."""
    slots = int(HISTORY_MINUTES * 60 / SLOT_SECONDS)
    # Slot-aligned, so that rank 1's report 0.1 s after rank 0's shares its slot: an unaligned
    # start put one pair in two slots about one run in fifty (361 points, not 360).
    start = (datetime.now(UTC).timestamp() // SLOT_SECONDS - slots) * SLOT_SECONDS
    for i in range(slots):
        t, step = start + i * SLOT_SECONDS, 10 * i
        for rank in (0, 1):
            base = 2e-4 * (1 + i / slots) * (1.1 if rank else 1.0)
            lat = [base * (1 + 0.1 * (k % 7)) for k in range(40)] + [base * 12, base * 30]
            counts = [0] * (len(LATENCY_BOUNDS) + 1)
            for x in lat:
                counts[latency_bin(x)] += 1
            gather = [0] * (len(LATENCY_BOUNDS) + 1)
            gather[latency_bin(6e-5)] = 4
            h(run, CommEvent(
                rank=rank, step=step, method="powersgd", steps=10, buckets=40, raw_bytes=1,
                sent_bytes=1, rel_error=0.0, hook_seconds=0.0, allreduce_seconds=sum(lat),
                world_size=2, time=t + 0.1 * rank,
                collectives=[{"op": "all_reduce", "size": "1MiB", "calls": len(lat),
                              "bytes": 1, "seconds": sum(lat), "counts": counts},
                             {"op": "all_gather", "size": "4KiB", "calls": 4, "bytes": 1,
                              "seconds": 2.4e-4, "counts": gather}]))
            if probe and i % 12 == 0:
                h(run, ProbeEvent(
                    rank=rank, step=step, op="all_reduce", world_size=2, sizes=PROBE_SIZES,
                    seconds=[(20e-6 + size / 150e9) * (1 + 0.2 * (i % 5 == 0))
                             for size in PROBE_SIZES], time=t))


def fill_hardware_history(h: HardwareHistory, gpus: int = 2) -> None:
    """Half an hour of samples: a busy host and, with ``gpus``, GPUs at work over NVLink."""
    start = datetime.now(UTC).timestamp() - HISTORY_MINUTES * 60
    n = int(HISTORY_MINUTES * 60 / 5)
    for i in range(n):
        wave = math.sin(i / 20)
        picked = [
            ("traind_host_cpu_usage_ratio", {}, 0.6 + 0.3 * wave),
            ("traind_host_memory_used_bytes", {}, (90 + 5 * wave) * GiB),
            ("traind_host_memory_total_bytes", {}, 251.5 * GiB),
            ("traind_gpu_devices", {}, gpus),
        ]
        for g in range(gpus):
            lab = {"gpu": str(g)}
            picked += [
                ("traind_gpu_info", {**lab, "name": "NVIDIA H100 80GB HBM3"}, 1),
                ("traind_gpu_utilization_ratio", lab, 0.85 + 0.1 * wave * (1 - g / 2)),
                ("traind_gpu_power_watts", lab, 610 + 80 * wave),
                ("traind_gpu_power_limit_watts", lab, 700),
                ("traind_gpu_memory_used_bytes", lab, 61.4 * GiB),
                ("traind_gpu_pcie_throughput_bytes_per_second", {**lab, "direction": "tx"},
                 1.3 * GiB * (1 + wave / 2)),
                ("traind_gpu_pcie_throughput_bytes_per_second", {**lab, "direction": "rx"},
                 0.4 * GiB),
                *(("traind_gpu_nvlink_bytes_total", {**lab, "link": str(k), "direction": d},
                   i * 5 * 20 * GiB / 18) for k in range(18) for d in ("tx", "rx")),
            ]
        h.record(pick(picked), at=start + 5 * i)


def int8_verdict() -> dict[str, Any]:
    """A finished two-arm experiment's verdict: int8 faster than none, loss within margin."""
    return {"int8": {"kind": "better", "pairs": 12, "ratio": 1.183, "low": 1.121,
                     "high": 1.248, "p_value": 0.0012,
                     "interval": "95% always-valid confidence sequence",
                     "reason": "int8 is 1.183x faster than none (95% CS 1.121-1.248)"}}


def finished_autotune(tune_id: int = 7, target_run_id: int | None = 3) -> AutotuneInfo:
    """A search that ran both stages: bf16 beat fp32 (on speed, then on its own weights in a
    quality round), then int8 beat none at bf16 (powersgd
    was inconclusive, topk rejected; the next round's experiment failed, so powersgd counts as
    failed); fp8 was left out; the winner went to run 3."""
    none = {"method": "none"}

    def c(p: str, comp: dict[str, Any]) -> dict[str, Any]:
        return Candidate(p, comp).as_dict()  # with the name the daemon gives it

    psgd = {"method": "powersgd", "powersgd_rank": 4}
    rounds = [
        {"stage": "precision", "index": 0, "steps": 200, "baseline": c("fp32", none),
         "challengers": [c("bf16", none)], "experiment_id": 11,
         "verdicts": {"bf16.none": {"kind": "better", "ratio": 1.412, "low": 1.351,
                                    "high": 1.476, "reason": "bf16.none is 1.412x faster"}}},
        {"stage": "precision", "phase": "quality", "index": 0, "steps": 100,
         "baseline": c("fp32", none), "challengers": [c("bf16", none)], "experiment_id": 14,
         "speed": {"bf16.none": 1.412},
         "verdicts": {"bf16.none": {
             "kind": "inconclusive (budget spent)", "ratio": 1.39, "low": 0.9, "high": 2.1,
             "reason": "validation loss non-inferior (\u0394 -0.004 < margin 0.05 nats)",
             "quality": {"status": "non-inferior", "diff": -0.004, "upper": 0.01,
                         "margin": 0.05, "measure": "validation loss"}}}},
        {"stage": "compression", "index": 0, "steps": 200, "baseline": c("bf16", none),
         "challengers": [c("bf16", {"method": "int8"}), c("bf16", psgd),
                         c("bf16", {"method": "topk"})], "experiment_id": 12,
         "verdicts": {
             "bf16.int8": {"kind": "better", "ratio": 1.183, "low": 1.121, "high": 1.248,
                           "reason": "bf16.int8 is 1.183x faster"},
             "bf16.powersgd-rank4": {"kind": "inconclusive (budget spent)", "ratio": 1.02,
                                     "low": 0.97, "high": 1.07, "reason": "budget spent"},
             "bf16.topk": {"kind": "rejected (quality)", "ratio": 1.3, "low": 1.2,
                           "high": 1.4, "reason": "loss 9% worse than bf16.none"}}},
        {"stage": "compression", "index": 1, "steps": 400,
         "baseline": c("bf16", {"method": "int8"}), "challengers": [c("bf16", psgd)],
         "experiment_id": 13, "verdicts": {}},  # its experiment failed: no verdicts
    ]
    return AutotuneInfo(
        id=tune_id, name="tune-small", state="done",
        best={"precision": "bf16", "compression": {"method": "int8"}, "bucket_mb": None},
        infeasible=[{"candidate": "fp8.none",
                     "reason": "fp8 needs a GPU with fp8 tensor cores (compute capability "
                               "8.9+) and torchao; this node runs on cpu"}],
        rounds=rounds, error=None, target_run_id=target_run_id, config_hash="feedbeef",
        versions={"traind": "0.1.0", "torch": "2.13.0", "device": "cpu"},
        created_at=T0, finished_at=T0 + timedelta(hours=2))


def sample_promotions(run_id: int = 3) -> list[PromotionView]:
    """Newest first: one kept, one rolled back for a loss spike."""
    ev: dict[str, Any] = {"autotune_id": 7}
    return [
        PromotionView(id=2, run_id=run_id, autotune_id=7, seq=2, state="kept",
                      setting={"precision": "bf16", "compression": {"method": "int8"}},
                      previous={"precision": "fp32", "compression": {"method": "none"}},
                      evidence=ev, applied_step=1400, reason=None, created_at=T0,
                      applied_at=T0 + timedelta(minutes=3), ended_at=None),
        PromotionView(id=1, run_id=run_id, autotune_id=None, seq=1, state="rolled_back",
                      setting={"compression": {"method": "topk", "topk_ratio": 0.01}},
                      previous={"precision": "fp32", "compression": {"method": "none"}},
                      evidence={}, applied_step=800,
                      reason="loss spike: 7.9 against a median of 3.2",
                      created_at=T0 - timedelta(hours=1), applied_at=None,
                      ended_at=T0 - timedelta(minutes=50)),
    ]


def sample_trials() -> list[QueuedTrial]:
    return [QueuedTrial(id=i, experiment_id=5, experiment="forked-bf16", arm=arm, repeat=r,
                        priority=i)
            for i, (arm, r) in enumerate((("fp32", 0), ("bf16", 0), ("fp32", 1)), start=21)]


def step_message(run: int, step: int) -> dict[str, Any]:
    """A plausible step: loss decaying from ~8, throughput and grad norm with some wobble."""
    wobble = (math.sin(step * 12.9898) * 43758.5453) % 1  # deterministic noise in [0, 1)
    return {
        "type": "step",
        "run": run,
        "step": step,
        "loss": 2.8 + 5.5 / (1 + step / 40) + 0.15 * wobble,
        "lr": 3e-4,
        "grad_norm": 0.6 + 2.5 / (1 + step / 30) + 0.2 * wobble,
        "tokens_per_second": 50000 + 3000 * wobble,
        "step_seconds": 0.08,
        "time": 1.7e9 + step,
    }


def eval_message(run: int, step: int) -> dict[str, Any]:
    return {
        "type": "eval",
        "run": run,
        "step": step,
        "val_loss": 3.0 + 5.5 / (1 + step / 40),
        "time": 1.7e9 + step,
    }


class LiveServer:
    """uvicorn serving an app on a free 127.0.0.1 port, its event loop in a background thread.

    ``loop`` is the server's loop: the hub must be published to from it
    (``asyncio.run_coroutine_threadsafe(coro, server.loop)``).
    """

    def __init__(self, app: Any) -> None:
        # port=0: the OS picks a free port at bind time, so there is no probe-then-bind race.
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> LiveServer:
        self._thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def service() -> FakeService:
    """Runs, a 2-GPU host and a 2-rank run's communication (their history too): every page
    has something."""
    s = FakeService(
        run_views=sample_runs(), metric_samples=[*host_samples(), *gpu_samples(2), *comm_samples()]
    )
    fill_comm_history(s.comm)
    fill_hardware_history(s.hardware)
    return s


@pytest.fixture
def canned() -> dict[str, Callable[..., Any]]:
    """The sample builders, for tests that want a node without GPUs or without DDP (and the
    history fillers: ``comm_history(h, run, probe=)``, ``hardware_history(h, gpus)``)."""
    return {"host": host_samples, "gpu": gpu_samples, "comm": comm_samples,
            "comm_history": fill_comm_history, "hardware_history": fill_hardware_history}


@pytest.fixture
def fake_service() -> type[FakeService]:
    """The class, for tests that want a service with other runs or health."""
    return FakeService


@pytest.fixture
def token() -> str:
    """The fake daemon's token."""
    return TOKEN


@pytest.fixture
def auth(token: str) -> dict[str, str]:
    """The API's header for the fake daemon's token."""
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def session_client(service: FakeService) -> Iterator[Any]:
    """A TestClient of the app over ``service``, logged in (a session, as a browser's)."""
    from fastapi.testclient import TestClient

    from traind.web.app import create_app

    with TestClient(create_app(service, title="traind-test",
                               allowed_hosts=["testserver"])) as c:
        log_in(c)
        yield c


@pytest.fixture
def make_verdict() -> Callable[[], dict[str, Any]]:
    return int8_verdict


@pytest.fixture
def make_autotune() -> Callable[..., AutotuneInfo]:
    return finished_autotune


@pytest.fixture
def make_promotions() -> Callable[..., list[PromotionView]]:
    return sample_promotions


@pytest.fixture
def make_trials() -> Callable[[], list[QueuedTrial]]:
    return sample_trials


@pytest.fixture
def make_step() -> Callable[[int, int], dict[str, Any]]:
    return step_message


@pytest.fixture
def make_eval() -> Callable[[int, int], dict[str, Any]]:
    return eval_message


@pytest.fixture
def live_server() -> type[LiveServer]:
    return LiveServer


def log_in(client: Any, token: str = TOKEN) -> Any:
    """Trade the token for a session cookie in ``client`` (a TestClient), as a browser does
    at /login; the session (web.sessions.Session) is returned."""
    from traind.web.sessions import COOKIE

    r = client.post("/login", data={"token": token, "next": "/"}, follow_redirects=False)
    assert r.status_code == 303, (r.status_code, r.text)
    session = client.app.state.sessions.get(client.cookies.get(COOKIE))
    assert session is not None
    return session
