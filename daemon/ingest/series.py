"""A run's step series, kept for its run page: gathered in columns, stored one row a second.

One database row per step would make the database the bottleneck of a fast job; none would
leave a finished run's curves nowhere once the hub forgets them. So the lead rank's step and
layer events are gathered here per run, in columns, and each flush seals what came since the
last one into a single run-event row (``kind`` :data:`STEPS` or :data:`LAYERS`, ``step`` its
first step, ``data`` the columns) in the event buffer, which holds it until the database takes
it, like every other run event. ``daemon/runs/series.py`` reads them back.

A run of more than one rank also keeps what differs between its ranks (:data:`RANK_COLUMNS`,
every rank this node runs) in one :data:`RANK_STEPS` row per flush, a row of columns per
report with the rank as a column: a straggler shows as one rank's line apart from the rest.

Its communication too, every rank's (:data:`COMM`, one row per flush): per report and rank
the bytes before and after compression (``reports``), and per report, rank, op and size
bucket the collectives' calls, bytes, seconds and latency-bucket counts (``collectives``):
what the run's page draws per op, after the run ended and after a restart. At most
:data:`COMM_ROWS` collective rows a flush per run; past that, a report is folded into the
newest row of its rank, op and size (its step the later), so a burst costs resolution, never
totals or memory.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from traind.contracts.events import CommEvent, LayerEvent, StepEvent
from traind.daemon.ingest.messages import finite
from traind.metrics.throughput import rank_tokens_per_second

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.contracts.events import Event

STEPS, LAYERS, RANK_STEPS, COMM = "steps", "layers", "rank_steps", "comm"  # sealed chunks' kinds
# The step columns, in the order the CSV export writes them (the hub's step message's names).
STEP_COLUMNS = ("step", "time", "loss", "lr", "grad_norm", "tokens_per_second",
                "step_seconds", "data_seconds")
LAYER_COLUMNS = ("grad_norm", "update_ratio")  # per step, one value per layer
# Per rank and report: its own step phases and data wait, its tokens over its step time, and
# its loss (each rank's own batch's: the trainer reports it before any all-reduce, so ranks
# differ). Not lr or the grad norm: the same on every rank after DDP's all-reduce.
RANK_COLUMNS = ("step", "rank", "loss", "tokens_per_second", "step_seconds", "data_seconds",
                "forward_seconds", "backward_seconds", "optimizer_seconds")

# A comm chunk's two tables. ``steps``: the optimizer steps the report covers; ``world_size``:
# the collectives' group (for the bus-bandwidth factors); ``counts``: one list per row, a
# count per latency bucket of contracts.comm.LATENCY_BOUNDS and +Inf.
# ``mesh_dim``: the dimension whose group communicated (contracts/mesh.py); chunks stored
# before it was a column have none, and are dp's (comm_series.merge_comm fills it in).
COMM_REPORT_COLUMNS = ("step", "rank", "steps", "raw_bytes", "sent_bytes", "mesh_dim")
COMM_COLUMNS = ("step", "rank", "op", "size", "calls", "bytes", "seconds", "counts",
                "world_size", "mesh_dim")
# 64 ranks x 4 ops x 4 sizes x 4 reports a second; a run past it loses resolution, not data.
COMM_ROWS = 4096


class Holder(Protocol):
    """Where sealed chunks go: the event buffer (live), or a replay's list of rows."""

    def add(self, run_id: int, event: dict[str, Any]) -> None: ...


class SeriesRecorder:
    """The router's observer (lead rank only) and the flush's first writer (``seal``)."""

    def __init__(self, tokens_per_second: Callable[[int], float],
                 world_size: Callable[[int], int] = lambda run: 1) -> None:
        """``tokens_per_second(run)``: the run's figure as its summary holds it after the
        event (the one the live page shows); ``world_size(run)``: its ranks (one: no per-rank
        rows, they would repeat the lead's)."""
        self._tps, self._world_size = tokens_per_second, world_size
        self._steps: dict[int, dict[str, list[Any]]] = {}
        self._ranks: dict[int, dict[str, list[Any]]] = {}
        self._layers: dict[int, list[dict[str, Any]]] = {}
        self._comm: dict[int, dict[str, dict[str, list[Any]]]] = {}
        # (run, rank, op, size) -> its newest collective row's index, for the fold past the cap
        self._comm_at: dict[tuple[int, int, str, str, str], int] = {}
        self._lock = threading.Lock()  # observe runs on the loop, seal in the flush's thread

    def __call__(self, run_id: int, event: Event) -> None:
        if isinstance(event, StepEvent):
            # JSON (the column's type, the spill file, the page) has no NaN: None instead.
            row = (event.step, event.time, finite(event.loss), event.lr,
                   finite(event.grad_norm), self._tps(run_id), event.step_seconds,
                   event.data_seconds)
            with self._lock:
                cols = self._steps.setdefault(run_id, {c: [] for c in STEP_COLUMNS})
                for name, value in zip(STEP_COLUMNS, row, strict=True):
                    cols[name].append(value)
        elif isinstance(event, LayerEvent):
            with self._lock:
                chunks = self._layers.setdefault(run_id, [])
                if not chunks or chunks[-1]["layers"] != event.layers:
                    # A new layout (another model after a promotion) starts a chunk of its own.
                    chunks.append({"layers": list(event.layers), "step": [],
                                   **{c: [] for c in LAYER_COLUMNS}})
                chunk = chunks[-1]
                chunk["step"].append(event.step)
                chunk["grad_norm"].append([finite(v) for v in event.grad_norm])
                chunk["update_ratio"].append([finite(v) for v in event.update_ratio])

    def every_rank(self, run_id: int, event: Event) -> None:
        """The router's observer for every rank: a multi-rank run's per-rank figures and
        every rank's communication."""
        if isinstance(event, CommEvent):
            self._comm_event(run_id, event)
            return
        if not isinstance(event, StepEvent) or self._world_size(run_id) <= 1:
            return
        row = (event.step, event.rank, finite(event.loss),
               finite(rank_tokens_per_second(event)), event.step_seconds, event.data_seconds,
               event.forward_seconds, event.backward_seconds, event.optimizer_seconds)
        with self._lock:
            cols = self._ranks.setdefault(run_id, {c: [] for c in RANK_COLUMNS})
            for name, value in zip(RANK_COLUMNS, row, strict=True):
                cols[name].append(value)

    def _comm_event(self, run_id: int, event: CommEvent) -> None:
        with self._lock:
            chunk = self._comm.setdefault(run_id, {
                "reports": {c: [] for c in COMM_REPORT_COLUMNS},
                "collectives": {c: [] for c in COMM_COLUMNS}})
            rep = chunk["reports"]
            for name, value in zip(COMM_REPORT_COLUMNS, (event.step, event.rank, event.steps,
                                   event.raw_bytes, event.sent_bytes, event.mesh_dim),
                                   strict=True):
                rep[name].append(value)
            cols = chunk["collectives"]
            for c in event.collectives:
                key = (run_id, event.rank, event.mesh_dim, c["op"], c["size"])
                at = self._comm_at.get(key)
                if at is not None and len(cols["step"]) >= COMM_ROWS:
                    cols["step"][at] = max(cols["step"][at], event.step)
                    for name in ("calls", "bytes", "seconds"):
                        cols[name][at] += c[name]
                    cols["counts"][at] = [a + int(b) for a, b in
                                          zip(cols["counts"][at], c["counts"], strict=True)]
                    continue
                self._comm_at[key] = len(cols["step"])
                row = (event.step, event.rank, c["op"], c["size"], int(c["calls"]),
                       int(c["bytes"]), float(c["seconds"]), [int(n) for n in c["counts"]],
                       event.world_size, event.mesh_dim)
                for name, value in zip(COMM_COLUMNS, row, strict=True):
                    cols[name].append(value)

    def seal(self, buffer: Holder) -> None:
        """Move what was gathered into ``buffer``: one row per run and kind (and layout)."""
        with self._lock:
            steps, self._steps = self._steps, {}
            layers, self._layers = self._layers, {}
            ranks, self._ranks = self._ranks, {}
            comm, self._comm, self._comm_at = self._comm, {}, {}
        for run_id, cols in steps.items():
            buffer.add(run_id, {"kind": STEPS, "step": cols["step"][0], "data": cols})
        for run_id, cols in ranks.items():
            buffer.add(run_id, {"kind": RANK_STEPS, "step": min(cols["step"]), "data": cols})
        for run_id, tables in comm.items():
            buffer.add(run_id, {"kind": COMM, "step": min(tables["reports"]["step"]),
                                "data": tables})
        for run_id, chunks in layers.items():
            for chunk in chunks:
                buffer.add(run_id, {"kind": LAYERS, "step": chunk["step"][0], "data": chunk})
