"""A run's stored communication, read back per op over steps for a poll's tail. Pure functions.

The chunks are the :data:`~traind.daemon.ingest.series.COMM` rows ``SeriesRecorder`` seals:
per report and rank, the bytes before and after compression; per report, rank, op and size
bucket, the collectives' calls, bytes, seconds and latency-bucket counts. A page wants per op
a line over steps, so each point sums every rank and size bucket of the reports it stands
for (a bucket of reports on a long run: sums, not means of means, so a point's percentiles
are those of all its calls). From the sums:

- ``calls``: calls per rank and optimizer step (the gradient buckets DDP hands the hook);
- ``bytes_per_second`` and ``bus_bandwidth``: ``metrics.arithmetic.window_bandwidth``, the
  definition the exported gauges use, of a rank's mean bytes over its mean seconds;
- ``mean``, ``p50``, ``p95``, ``p99``: latency, seconds, the percentiles from the summed
  buckets by ``bucket_quantile`` (PromQL's method: the page and Grafana agree);
- ``bytes``: raw and sent per rank and optimizer step, and their ratio (the compression).

A tail is a few chunks at full resolution, one point a report; a whole page folds the same
sums as the chunks stream by (``daemon/runs/series_fold.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traind.contracts.comm import LATENCY_BOUNDS
from traind.daemon.ingest.comm_history import QUANTILES, line_name
from traind.daemon.ingest.series import COMM_COLUMNS, COMM_REPORT_COLUMNS
from traind.metrics.arithmetic import bucket_quantile, window_bandwidth

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

Rows = dict[str, list[Any]]  # columns


def merge_comm(chunks: Iterable[dict[str, Any]]) -> tuple[Rows, Rows]:
    """The chunks' report and collective rows, each by step; a (step, rank[, op, size]) seen
    twice (redone after a restart) keeps its newest figures, as ``merge_steps``."""
    reports: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    colls: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for chunk in chunks:
        rep = chunk["reports"]
        for row in zip(*(column(rep, c) for c in COMM_REPORT_COLUMNS), strict=True):
            reports[(*row[:2], row[-1])] = row
        col = chunk["collectives"]
        for row in zip(*(column(col, c) for c in COMM_COLUMNS), strict=True):
            colls[(*row[:4], row[-1])] = row
    return _columns(reports, COMM_REPORT_COLUMNS), _columns(colls, COMM_COLUMNS)


def column(table: dict[str, list[Any]], name: str) -> list[Any]:
    """A stored table's column; ``mesh_dim`` of a chunk stored before it was one: all dp
    (the DDP hook's collectives were the only ones counted then)."""
    if name == "mesh_dim" and name not in table:
        return ["dp"] * len(table["step"])
    return table[name]



def _columns(rows: dict[tuple[Any, ...], tuple[Any, ...]], names: Sequence[str]) -> Rows:
    ordered = [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1:]))]
    return {name: [r[i] for r in ordered] for i, name in enumerate(names)}


def _per_step(reports: Rows, colls: Rows, after: int
              ) -> tuple[dict[int, tuple[int, int, int]],
                         dict[tuple[str, str], dict[int, list[Any]]]]:
    """Sums per report step: (rank steps, raw, sent) of the hook's (dp) reports, zeros for a
    step with only other dimensions'; and per (op, mesh dim) and step [calls, bytes, seconds,
    counts, world size, rank steps], over ranks and size buckets, of the steps from ``after``
    on."""
    steps: dict[tuple[int, int, str], int] = {}
    per_report: dict[int, tuple[int, int, int]] = {}
    for s, rank, n, raw, sent, dim in zip(*(reports[c] for c in COMM_REPORT_COLUMNS),
                                          strict=True):
        if s < after:
            continue
        steps[(s, rank, dim)] = max(int(n), 1)
        a, b, c = per_report.get(s, (0, 0, 0))
        if dim == "dp":  # the raw and sent bytes are the gradient hook's
            a, b, c = a + max(int(n), 1), b + int(raw), c + int(sent)
        per_report[s] = (a, b, c)
    ops: dict[tuple[str, str], dict[int, list[Any]]] = {}
    seen: set[tuple[str, str, int, int]] = set()
    for s, rank, op, _size, calls, nbytes, secs, counts, world, dim in zip(
            *(colls[c] for c in COMM_COLUMNS), strict=True):
        if s < after:
            continue
        acc = ops.setdefault((op, dim), {}).setdefault(
            s, [0, 0, 0.0, [0] * (len(LATENCY_BOUNDS) + 1), 0, 0])
        acc[0] += calls
        acc[1] += nbytes
        acc[2] += secs
        acc[3] = [x + y for x, y in zip(acc[3], counts, strict=True)]
        acc[4] = max(acc[4], world)
        if (op, dim, s, rank) not in seen:  # a rank's steps count once per op, not per size
            seen.add((op, dim, s, rank))
            acc[5] += steps.get((s, rank, dim), 1)
    return per_report, ops


def _op_line(op: str, dim: str, points: Sequence[tuple[int, list[Any]]],
             spans: Sequence[tuple[int, int]]) -> dict[str, Any]:
    line: dict[str, Any] = {"op": line_name(op, dim), "mesh_dim": dim, "step": [],
                            "calls": [], "bytes_per_second": [], "bus_bandwidth": [],
                            "mean": [], **{q: [] for q in QUANTILES}}
    for a, b in spans:
        got = [p for _, p in points[a:b]]
        calls, nbytes, secs = (sum(p[i] for p in got) for i in range(3))
        counts = [sum(col) for col in zip(*(p[3] for p in got), strict=True)]
        world = max(p[4] for p in got)
        rank_steps = max(sum(p[5] for p in got), 1)
        # Summed over ranks, bytes and seconds are each k x a rank's mean: the ratio is the
        # mean rank's bandwidth.
        algbw, busbw = window_bandwidth(op, nbytes, secs, world)
        line["step"].append(points[b - 1][0])
        line["calls"].append(calls / rank_steps)
        line["bytes_per_second"].append(algbw if secs > 0 else None)
        line["bus_bandwidth"].append(busbw if secs > 0 and world > 1 else None)
        line["mean"].append(secs / calls if calls else None)
        for name, q in QUANTILES.items():
            line[name].append(bucket_quantile(q, LATENCY_BOUNDS, counts))
    return line


def comm_lines(reports: Rows, colls: Rows, points: int, after: int) -> dict[str, Any]:
    """Per op a line over the reports from step ``after`` on, one point each, the first
    ``points`` of them (``more`` says some were left out); ``bytes``: raw and sent bytes per
    rank and step, and their ratio. Empty lists for a run without communication (one
    rank)."""
    per_report, ops = _per_step(reports, colls, after)
    report_steps = sorted(per_report)
    more = len(report_steps) > points
    report_steps = report_steps[:points]
    # A poll's tail ends at its last report; the rest comes with the next poll.
    last = report_steps[-1] if report_steps else None
    lines = []
    for op, dim in sorted(ops, key=lambda k: (k[1] != "dp", k[1], k[0])):
        pts = [p for p in sorted(ops[(op, dim)].items()) if last is not None and p[0] <= last]
        if pts:
            lines.append(_op_line(op, dim, pts, [(i, i + 1) for i in range(len(pts))]))
    raw, sent, ratio = [], [], []
    for s in report_steps:
        n, r, t = per_report[s]
        raw.append(r / n if n else None)  # None: no hook report (tp or pp only)
        sent.append(t / n if n else None)
        ratio.append(r / t if t else None)
    return {"reports": len(per_report), "more": more, "ops": lines,
            "bytes": {"step": report_steps, "raw": raw, "sent": sent, "ratio": ratio}}
