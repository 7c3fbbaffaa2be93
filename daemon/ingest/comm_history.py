"""Communication over time, per run: what the Communication page charts, in bounded buffers.

``/metrics`` holds totals and the latest value (Prometheus keeps the history); the daemon's
own page needs the recent past without a Prometheus. So every rank's comm and probe events
are folded here, as the router hands them over:

- **latency**: each op's collective-latency bucket counts (``contracts.comm.LATENCY_BOUNDS``,
  the same bins the histogram ``traind_comm_collective_latency_seconds`` exports), summed over
  ranks and message sizes per time slot of :data:`SLOT_SECONDS`. Percentiles are computed from
  these buckets, not raw samples: raw latencies never cross the worker boundary (a rank bins
  them before it reports, to keep the hot path cheap), and ``bucket_quantile`` is PromQL's
  method, so the page and a Grafana panel of the histogram agree.
- **latency** lines are per op and mesh dimension ("all_gather (tp)" beside dp's plain op);
- **mesh** (daemon/ingest/mesh_history.py): the ranks by mesh coordinate, bytes and time per
  mesh dimension, the bubble per pipeline stage, for a run with tp or pp beyond 1;
- **probe**: per op and message size, each probe's bus bandwidth (``bus_bandwidth``, the one
  definition the exported gauge uses too) from the slowest rank's median: a collective ends
  for all when the last rank is done.

Memory is bounded: :data:`SLOTS` slots per op and :data:`PROBES` probes per size, per run, and
an ended run is forgotten with its hub series (its totals stay in the DB and Prometheus).
Runs on the event loop (the router's observer) and is read there.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traind.contracts.comm import LATENCY_BOUNDS
from traind.contracts.events import CommEvent, LifecycleEvent, PipelineEvent, ProbeEvent
from traind.daemon.ingest.mesh_history import MeshFold
from traind.metrics.arithmetic import bucket_quantile, bus_bandwidth

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from traind.contracts.events import Event

SLOT_SECONDS = 5.0  # one latency point per op per 5 s, whatever telemetry.every is
SLOTS = 720  # an hour of slots per op; Grafana is the long-term store
PROBES = 240  # probes per message size (telemetry.probe_every steps apart)
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


@dataclass(slots=True)
class _Slot:
    slot: int  # floor(time / SLOT_SECONDS)
    time: float  # the newest event's
    step: int  # the newest step seen in it
    calls: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))


@dataclass(slots=True)
class _Probe:
    step: int
    time: float
    seconds: float  # the slowest rank's median so far
    world_size: int


def line_name(op: str, mesh_dim: str) -> str:
    """A line's name: the op, with the mesh dimension where it is not dp's (the hook's)."""
    return op if mesh_dim == "dp" else f"{op} ({mesh_dim})"


def latency_columns(slots: Iterable[_Slot]) -> dict[str, list[Any]]:
    """Columns for a chart: time, step, calls and each of :data:`QUANTILES` (seconds)."""
    rows = list(slots)
    out: dict[str, list[Any]] = {"time": [s.time for s in rows], "step": [s.step for s in rows],
                                 "calls": [s.calls for s in rows]}
    for name, q in QUANTILES.items():
        out[name] = [bucket_quantile(q, LATENCY_BOUNDS, s.counts) for s in rows]
    return out


def probe_columns(op: str, size: int, probes: Iterable[_Probe]) -> dict[str, list[Any]]:
    rows = list(probes)
    return {"time": [p.time for p in rows], "step": [p.step for p in rows],
            "latency": [p.seconds for p in rows],
            "bus_bandwidth": [bus_bandwidth(size, p.seconds, p.world_size, op) for p in rows]}


class CommHistory:
    """The router's observer for every rank (``__call__``); ``snapshot`` for the page."""

    def __init__(self, *, slots: int = SLOTS, probes: int = PROBES,
                 clock: Callable[[], float] = time.time) -> None:
        self._slots, self._probes, self._clock = slots, probes, clock
        self._latency: dict[int, dict[str, deque[_Slot]]] = {}
        self._probe: dict[int, dict[tuple[str, int], deque[_Probe]]] = {}
        self._mesh: dict[int, MeshFold] = {}  # every run's, shown once it has a mesh

    def __call__(self, run_id: int, event: Event) -> None:
        if isinstance(event, CommEvent):
            self._comm(run_id, event)
        elif isinstance(event, ProbeEvent):
            self._probe_event(run_id, event)
        if isinstance(event, (CommEvent, PipelineEvent, LifecycleEvent)):
            self._mesh.setdefault(run_id, MeshFold()).observe(event)

    def _comm(self, run_id: int, event: CommEvent) -> None:
        at = event.time or self._clock()
        slot_no = int(at // SLOT_SECONDS)
        ops = self._latency.setdefault(run_id, {})
        for c in event.collectives:
            slots = ops.setdefault(line_name(c["op"], event.mesh_dim),
                                   deque(maxlen=self._slots))
            # Ranks report the same steps a moment apart: their windows share a slot.
            slot = next((s for s in reversed(slots) if s.slot == slot_no), None)
            if slot is None and slots and slots[-1].slot > slot_no:
                slot = slots[-1]  # a late report: counted in the newest slot, not reordered
            if slot is None:
                slot = _Slot(slot_no, at, event.step)
                slots.append(slot)
            slot.time, slot.step = max(slot.time, at), max(slot.step, event.step)
            slot.calls += int(c["calls"])
            slot.counts = [a + int(b) for a, b in zip(slot.counts, c["counts"], strict=True)]

    def _probe_event(self, run_id: int, event: ProbeEvent) -> None:
        at = event.time or self._clock()
        sizes = self._probe.setdefault(run_id, {})
        for size, seconds in zip(event.sizes, event.seconds, strict=True):
            probes = sizes.setdefault((event.op, size), deque(maxlen=self._probes))
            # Every rank probes on the same steps: one point per probe, the slowest rank's.
            if probes and probes[-1].step == event.step:
                p = probes[-1]
                p.seconds, p.time = max(p.seconds, seconds), max(p.time, at)
            else:
                probes.append(_Probe(event.step, at, seconds, event.world_size))

    def forget(self, run_id: int) -> None:
        self._latency.pop(run_id, None)
        self._probe.pop(run_id, None)
        self._mesh.pop(run_id, None)

    def runs(self) -> list[int]:
        """Runs with communication history, newest first (a mesh counts: a pp-only job has
        no collectives to time, only its stages' traffic)."""
        meshed = {r for r, fold in self._mesh.items() if fold.view() is not None}
        return sorted({*self._latency, *self._probe, *meshed}, reverse=True)

    def snapshot(self, run: int | None = None) -> dict[str, Any]:
        """Run ``run``'s history (None: the newest run's): ``latency`` one entry per op,
        ``probe`` one per (op, message size), each with its columns."""
        runs = self.runs()
        if run is None:
            run = runs[0] if runs else None
        ops = self._latency.get(run, {}) if run is not None else {}
        fold = self._mesh.get(run) if run is not None else None
        sizes = self._probe.get(run, {}) if run is not None else {}
        return {
            "run": run, "runs": runs, "slot_seconds": SLOT_SECONDS,
            "latency": [{"op": op, **latency_columns(slots)}
                        for op, slots in sorted(ops.items())],
            "probe": [{"op": op, "size_bytes": size, **probe_columns(op, size, probes)}
                      for (op, size), probes in sorted(sizes.items())],
            "mesh": fold.view() if fold is not None else None,
        }
