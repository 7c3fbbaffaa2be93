"""A run's whole stored series for its page, folded as its chunks stream by. Pure.

Memory is bounded by the points a page asks for, not by the run's length. Merging every chunk
first, as the page once did, took ~600 MB and 9 s for a 146k-step two-rank run (~12,600
chunks, ~110 MB of JSON; issue 40.5). Here each line's steps are split by step range into at
most ``points`` buckets of equal step width, from the kind's first stored step to the
newest chunk's last, and each chunk's rows go into their buckets' sums, counts, minima and maxima
(numpy arrays of ``points`` rows) as the chunk passes; then the chunk is dropped. A bucket is
drawn at its newest step, at its mean, with its min and max as the envelope: a spike is
never averaged out of sight.

The chunks come newest first, so a step stored twice keeps its newest figures in O(1) memory:
a chunk supersedes, rank by rank, every older row of that rank from its first step on (a life
resumed from a checkpoint, or a rollback, trains those steps again; the curve shows the run's
history as it stands). A poll's tail stays with ``daemon/runs/series.py``: it reads a few
chunks, at full resolution.

The results hold numpy arrays (NaN: no value); ``web/encode.py`` writes them as JSON lists,
NaN as null, one array at a time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from traind.contracts.comm import LATENCY_BOUNDS
from traind.daemon.ingest.comm_history import QUANTILES, line_name
from traind.daemon.ingest.series import COMM_COLUMNS, LAYER_COLUMNS, STEP_COLUMNS
from traind.daemon.runs.comm_series import column
from traind.daemon.runs.series import (
    LAYER_COLUMNS_SHOWN,
    RANK_FIGURES,
    RANK_POINTS,
    straggler_table,
)
from traind.metrics.arithmetic import bucket_quantile, window_bandwidth

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

STEP_FIGURES = tuple(c for c in STEP_COLUMNS if c not in ("step", "time"))
# Per rank and figure, at most this many values kept for the medians of the rank table: every
# value up to it, then every other one, then every fourth... (a systematic sample).
MEDIAN_SAMPLE = 20_000


class Grid:
    """Steps ``lo``..``hi`` in ``min(points, hi - lo + 1)`` buckets of equal (fractional)
    step width; a step past ``hi`` (an older chunk's, beyond the newest) goes into the last."""

    def __init__(self, lo: int, hi: int, points: int) -> None:
        self.lo = lo
        self.span = max(hi, lo) - lo + 1
        self.n = max(1, min(points, self.span))

    def index(self, steps: np.ndarray) -> np.ndarray:
        return np.clip((steps - self.lo) * self.n // self.span, 0, self.n - 1)

    def of(self, step: int) -> int:
        return min(max((step - self.lo) * self.n // self.span, 0), self.n - 1)


class Cut:
    """Per rank, the first step of the newest chunks seen: their older rows from there on
    are superseded."""

    def __init__(self) -> None:
        self._at: dict[int, int] = {}

    def keep(self, ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
        if not self._at:
            return np.ones(steps.shape, bool)
        limit = np.array([self._at.get(int(r), np.iinfo(np.int64).max) for r in ranks.tolist()],
                         dtype=np.int64) if ranks.size else np.zeros(0, np.int64)
        return steps < limit

    def before(self, rank: int, step: int) -> bool:
        """Whether ``rank``'s ``step`` is not superseded."""
        at = self._at.get(rank)
        return at is None or step < at

    def update(self, ranks: np.ndarray, steps: np.ndarray) -> None:
        for r in np.unique(ranks).tolist():
            first = int(steps[ranks == r].min())
            self._at[r] = min(self._at.get(r, first), first)


def _floats(values: Sequence[Any]) -> np.ndarray:
    return np.array(values, dtype=np.float64)  # None -> NaN


class Envelopes:
    """Per bucket: kept rows, newest step and time, and per figure the sum, count, min and
    max of its finite values."""

    def __init__(self, grid: Grid, figures: int) -> None:
        self.grid = grid
        n = grid.n
        self.rows = np.zeros(n, np.int64)
        self.step = np.full(n, -1, np.int64)
        self.time = np.full(n, np.nan)
        self.sum = np.zeros((n, figures))
        self.count = np.zeros((n, figures), np.int64)
        self.min = np.full((n, figures), np.nan)
        self.max = np.full((n, figures), np.nan)

    def add(self, steps: np.ndarray, values: np.ndarray, times: np.ndarray | None = None
            ) -> None:
        """``values``: one row per step, one column per figure (NaN: none)."""
        if not steps.size:
            return
        b = self.grid.index(steps)
        np.add.at(self.rows, b, 1)
        np.maximum.at(self.step, b, steps)
        if times is not None:
            np.fmax.at(self.time, b, times)
        ok = np.isfinite(values)
        np.add.at(self.sum, b, np.where(ok, values, 0.0))
        np.add.at(self.count, b, ok)
        np.fmin.at(self.min, b, np.where(ok, values, np.nan))
        np.fmax.at(self.max, b, np.where(ok, values, np.nan))

    def filled(self) -> np.ndarray:
        return self.rows > 0

    def mean(self, col: int) -> np.ndarray:
        got = self.filled()
        with np.errstate(invalid="ignore", divide="ignore"):
            out = self.sum[got, col] / self.count[got, col]
        return np.where(self.count[got, col] > 0, out, np.nan)


def steps_page(chunks: Iterable[dict[str, list[Any]]], lo: int, points: int) -> dict[str, Any]:
    """``series.downsample``'s shape from the lead's step chunks (newest first): ``points``
    stored steps kept, per bucket its newest ``step`` and ``time`` and every figure's
    ``{"y", "lo", "hi"}``."""
    env: Envelopes | None = None
    cut = Cut()
    for chunk in chunks:
        steps = np.asarray(chunk["step"], np.int64)
        if not steps.size:
            continue
        if env is None:
            env = Envelopes(Grid(lo, int(steps.max()), points), len(STEP_FIGURES))
        zero = np.zeros(steps.shape, np.int64)
        keep = cut.keep(zero, steps)
        n = len(steps)
        values = np.column_stack([_floats(chunk.get(f) or [None] * n) for f in STEP_FIGURES])
        env.add(steps[keep], values[keep], _floats(chunk.get("time") or [None] * n)[keep])
        cut.update(zero, steps)
    if env is None:
        return {"points": 0, "step": [], "time": [],
                **{f: {"y": [], "lo": [], "hi": []} for f in STEP_FIGURES}}
    got = env.filled()
    out: dict[str, Any] = {"points": int(env.rows.sum()), "step": env.step[got],
                           "time": env.time[got]}
    for i, name in enumerate(STEP_FIGURES):
        out[name] = {"y": env.mean(i), "lo": env.min[got, i], "hi": env.max[got, i]}
    return out


class _Sample:
    """A systematic sample of at most ``2 * cap`` values (every value, then every other...)."""

    def __init__(self, cap: int = MEDIAN_SAMPLE) -> None:
        self.cap, self.stride, self.seen = cap, 1, 0
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add(self, values: np.ndarray) -> None:
        idx = (self.seen + np.arange(len(values))) % self.stride == 0
        self.seen += len(values)
        kept = values[idx].astype(np.float32)  # a median to show: float32's 7 digits do
        self.parts.append(kept)
        self.size += len(kept)
        if self.size > 2 * self.cap:
            whole = np.concatenate(self.parts)[::2]
            self.parts, self.size, self.stride = [whole], len(whole), self.stride * 2

    def values(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.float32)


def ranks_page(chunks: Iterable[dict[str, list[Any]]], lo: int, points: int
               ) -> dict[str, Any]:
    """``{"lines", "table"}`` of the per-rank chunks (newest first): a line per rank of each
    figure's bucket means (at most ``points``, fewer past ``RANK_POINTS`` in all: the
    grid is sized once the ranks are known, from the newest chunk), and each rank's medians
    (``series.straggler_table``) of a systematic sample of at most ``2 * MEDIAN_SAMPLE``
    steps."""
    cut = Cut()
    grid: Grid | None = None
    lines: dict[int, Envelopes] = {}
    samples: dict[int, list[_Sample]] = {}
    for chunk in chunks:
        steps = np.asarray(chunk["step"], np.int64)
        if not steps.size:
            continue
        ranks = np.asarray(chunk["rank"], np.int64)
        if grid is None:
            each = min(points, max(10, RANK_POINTS // max(len(np.unique(ranks)), 1)))
            grid = Grid(lo, int(steps.max()), each)
        keep = cut.keep(ranks, steps)
        n = len(steps)
        values = np.column_stack([_floats(chunk.get(f) or [None] * n) for f in RANK_FIGURES])
        k_ranks, k_steps, k_values = ranks[keep], steps[keep], values[keep]
        order = np.argsort(k_ranks, kind="stable")  # each rank's rows together, in order
        present, starts = np.unique(k_ranks[order], return_index=True)
        for r, rows in zip(present.tolist(), np.split(order, starts[1:]), strict=True):
            lines.setdefault(r, Envelopes(grid, len(RANK_FIGURES))).add(k_steps[rows],
                                                                         k_values[rows])
            kept = samples.setdefault(r, [_Sample() for _ in RANK_FIGURES])
            for j, sample in enumerate(kept):
                sample.add(k_values[rows, j])
        cut.update(ranks, steps)
    out_lines = []
    for r in sorted(lines):
        env = lines[r]
        got = env.filled()
        out_lines.append({"rank": r, "points": int(env.rows.sum()), "step": env.step[got],
                          **{name: env.mean(i) for i, name in enumerate(RANK_FIGURES)}})
    medians = {r: {name: _median(samples[r][j].values()) for j, name in enumerate(RANK_FIGURES)}
               for r in sorted(samples)}
    return {"lines": out_lines, "table": straggler_table(medians)}


def _median(values: np.ndarray) -> float | None:
    got = values[np.isfinite(values)]
    return float(np.median(got)) if got.size else None


def layers_page(chunks: Iterable[dict[str, Any]], lo: int,
                columns: int = LAYER_COLUMNS_SHOWN) -> dict[str, Any]:
    """``series.layer_map``'s shape from the layer chunks (newest first): the newest
    layout's reports, each column a bucket's mean per layer."""
    layout: list[str] | None = None
    env: dict[str, Envelopes] = {}
    step_env: Envelopes | None = None
    cut = Cut()
    for chunk in chunks:
        steps = np.asarray(chunk["step"], np.int64)
        if not steps.size:
            continue
        if layout is None:
            layout = list(chunk["layers"])
            grid = Grid(lo, int(steps.max()), columns)
            env = {name: Envelopes(grid, len(layout)) for name in LAYER_COLUMNS}
            step_env = Envelopes(grid, 0)
        if chunk["layers"] != layout:
            continue  # another model's (before a promotion): the newest layout is drawn
        zero = np.zeros(steps.shape, np.int64)
        keep = cut.keep(zero, steps)
        for name in LAYER_COLUMNS:
            rows = np.array([[math.nan if v is None else v for v in row]
                             for row in chunk[name]], dtype=np.float64).reshape(len(steps), -1)
            env[name].add(steps[keep], rows[keep])
        assert step_env is not None
        step_env.add(steps[keep], np.zeros((int(keep.sum()), 0)))
        cut.update(zero, steps)
    if layout is None or step_env is None:
        return {"layers": [], "step": [], **{c: [] for c in LAYER_COLUMNS}}
    got = step_env.filled()
    return {"layers": layout, "step": step_env.step[got],
            **{name: [env[name].mean(j) for j in range(len(layout))]
               for name in LAYER_COLUMNS}}


class _OpSums:
    """One op's (and mesh dimension's) sums per bucket of report steps."""

    def __init__(self, grid: Grid) -> None:
        n = grid.n
        self.step = np.full(n, -1, np.int64)
        self.calls = np.zeros(n, np.int64)
        self.bytes = np.zeros(n, np.int64)
        self.seconds = np.zeros(n)
        self.counts = np.zeros((n, len(LATENCY_BOUNDS) + 1), np.int32)  # calls per bucket
        self.world = np.zeros(n, np.int64)
        self.rank_steps = np.zeros(n, np.int64)


def comm_page(chunks: Iterable[dict[str, Any]], lo: int, points: int) -> dict[str, Any]:
    """``comm_series.comm_lines``' shape from the comm chunks (newest first): per op a line
    of at most ``points`` buckets of report steps, each the sums over its reports, ranks and
    size buckets; ``bytes``: raw and sent bytes per rank and step, and their ratio."""
    cut = Cut()
    grid: Grid | None = None
    ops: dict[tuple[str, str], _OpSums] = {}
    report_steps: set[int] = set()
    rep_n = rep_raw = rep_sent = rep_step = None
    for chunk in chunks:
        rep, col = chunk["reports"], chunk["collectives"]
        r_steps = np.asarray(rep["step"], np.int64)
        if not r_steps.size:
            continue
        r_ranks = np.asarray(rep["rank"], np.int64)
        if grid is None:
            grid = Grid(lo, int(r_steps.max()), points)
            rep_n, rep_raw, rep_sent = (np.zeros(grid.n, np.int64) for _ in range(3))
            rep_step = np.full(grid.n, -1, np.int64)
        assert rep_n is not None and rep_raw is not None and rep_sent is not None
        assert rep_step is not None
        keep = cut.keep(r_ranks, r_steps)
        # A rank's steps per report (and mesh dimension): what its collectives cover.
        covers: dict[tuple[int, int, str], int] = {}
        dims = column(rep, "mesh_dim")
        for i in np.flatnonzero(keep).tolist():
            s, rank, dim = int(r_steps[i]), int(r_ranks[i]), dims[i]
            n = max(int(rep["steps"][i]), 1)
            covers[(s, rank, dim)] = n
            report_steps.add(s)
            b = grid.of(s)
            rep_step[b] = max(rep_step[b], s)
            if dim == "dp":  # the raw and sent bytes are the gradient hook's
                rep_n[b] += n
                rep_raw[b] += int(rep["raw_bytes"][i])
                rep_sent[b] += int(rep["sent_bytes"][i])
        seen: set[tuple[str, str, int, int]] = set()
        rows = zip(*(column(col, c) for c in COMM_COLUMNS), strict=True)
        for s, rank, op, _size, calls, nbytes, secs, counts, world, dim in rows:
            if not cut.before(rank, s):
                continue  # superseded by a newer chunk of that rank
            sums = ops.get((op, dim))
            if sums is None:
                sums = ops[(op, dim)] = _OpSums(grid)
            b = grid.of(s)
            sums.step[b] = max(sums.step[b], s)
            sums.calls[b] += calls
            sums.bytes[b] += nbytes
            sums.seconds[b] += secs
            sums.counts[b] += np.asarray(counts, np.int32)
            sums.world[b] = max(sums.world[b], world)
            if (op, dim, s, rank) not in seen:  # a rank's steps count once per op, not size
                seen.add((op, dim, s, rank))
                sums.rank_steps[b] += covers.get((s, rank, dim), 1)
        cut.update(r_ranks, r_steps)
    if grid is None or rep_n is None or rep_raw is None or rep_sent is None or rep_step is None:
        return {"reports": 0, "more": False, "ops": [],
                "bytes": {"step": [], "raw": [], "sent": [], "ratio": []}}
    lines = [_op_line(op, dim, ops[(op, dim)])
             for op, dim in sorted(ops, key=lambda k: (k[1] != "dp", k[1], k[0]))]
    got = rep_step >= 0
    with np.errstate(invalid="ignore", divide="ignore"):
        per, raw, sent = rep_n[got], rep_raw[got].astype(float), rep_sent[got].astype(float)
        return {"reports": len(report_steps), "more": False, "ops": lines, "bytes": {
            "step": rep_step[got], "raw": np.where(per > 0, raw / per, np.nan),
            "sent": np.where(per > 0, sent / per, np.nan),
            "ratio": np.where(sent > 0, raw / sent, np.nan)}}


def _op_line(op: str, dim: str, s: _OpSums) -> dict[str, Any]:
    got = s.step >= 0
    calls, nbytes, secs = s.calls[got], s.bytes[got], s.seconds[got]
    world, rank_steps, counts = s.world[got], np.maximum(s.rank_steps[got], 1), s.counts[got]
    line: dict[str, Any] = {"op": line_name(op, dim), "mesh_dim": dim, "step": s.step[got],
                            "calls": calls / rank_steps}
    algbw, busbw = np.full(len(secs), np.nan), np.full(len(secs), np.nan)
    for i in np.flatnonzero(secs > 0).tolist():
        # Summed over ranks, bytes and seconds are each k x a rank's mean: the ratio is the
        # mean rank's bandwidth (metrics.arithmetic, the exported gauges' definition).
        a, b = window_bandwidth(op, int(nbytes[i]), float(secs[i]), int(world[i]))
        algbw[i] = a
        if world[i] > 1:
            busbw[i] = b
    line["bytes_per_second"], line["bus_bandwidth"] = algbw, busbw
    with np.errstate(invalid="ignore", divide="ignore"):
        line["mean"] = np.where(calls > 0, secs / np.maximum(calls, 1), np.nan)
    for name, q in QUANTILES.items():
        line[name] = _floats([bucket_quantile(q, LATENCY_BOUNDS, row) for row in
                              counts.tolist()])
    return line
