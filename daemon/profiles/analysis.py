"""Where a profiled step's time went: a capture's Chrome traces (one per rank) into its report.

Pure functions of the traces' JSON (torch.profiler's ``export_chrome_trace``), the figures
Holistic Trace Analysis computes, on the same definitions (its temporal breakdown and its
comm/comp overlap), for the timeline that does the work:

- **device** (a CUDA trace): the GPU's kernels. Communication is the NCCL kernels, compute every
  other kernel, memory copies and sets are their own bucket. HTA reads these traces, but not
  the CPU ones below, and its package pulls Jupyter into a daemon's environment (issue 17's
  note), so this module is ours; it is small because the definitions are.
- **host** (a CPU trace, gloo): the training thread's operators are compute; the collectives'
  spans (``gloo:*`` on gloo's threads, ``nccl:*``, ``c10d::*``) are communication.

Per traced step (the trainer's ``traind.step#<n>`` annotation, trainer/profiling.py) and rank:
``compute`` and ``comm`` are the lengths of the unions of those intervals within the step;
``exposed_comm`` is communication no compute overlaps; ``idle`` is the step's time in
neither; ``compute + exposed_comm + memcpy_only + idle = window`` exactly, and ``overlap`` is
the share of communication that compute hides. The top operators are by self time (a
parent's time less its children's, per thread: ``aten::linear`` is not counted again in
``aten::addmm``); the memory series is the profiler's allocator record. The straggler view
lines the ranks up on the shared clock (each trace's times less its rank's clock offset,
trainer/clocksync.py): per step, when each rank reached its first collective.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

STEP_MARK = re.compile(r"^traind\.step#(\d+)$")  # trainer/profiling.STEP_MARK
# a collective's span on the host (gloo's run-loop threads, ProcessGroup ops) or the device
HOST_COMM = re.compile(r"^(gloo|nccl|mpi|ucc):|^c10d::|^record_param_comms$")
DEVICE_COMM = re.compile(r"nccl", re.IGNORECASE)
DEVICE_MEMORY = ("gpu_memcpy", "gpu_memset")
TOP_OPS = 15
MEMORY_POINTS = 400  # the memory chart's points per rank, at most
DEVICE_TYPES = {0: "cpu", 1: "cuda"}

Interval = tuple[float, float]


class TraceError(ValueError):
    """A file that is not a trace this module can read (named in the message)."""


def load_trace(path: Path) -> dict[str, Any]:
    """A trace file (gzipped or not) as its JSON object."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as f:
            body = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise TraceError(f"{path.name}: not a readable trace: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("traceEvents"), list):
        raise TraceError(f"{path.name}: not a Chrome trace (no traceEvents list)")
    return body


# -- intervals ---------------------------------------------------------------------------------

def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(merged: list[Interval]) -> float:
    return sum(end - start for start, end in merged)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Of two merged lists (two pointers: linear)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(merged: list[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]


# -- one rank's trace --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Timelines:
    """One rank's trace, sorted into what the report measures (times in µs, the trace's)."""

    timeline: str  # "device" or "host"
    steps: dict[int, Interval]  # training step -> its window
    compute: list[Interval]  # merged
    comm: list[Interval]  # merged
    memcpy: list[Interval]  # merged (device only)
    first_comm: dict[int, float]  # step -> the start of its first collective
    base_us: float  # the trace's time origin, unix µs (baseTimeNanoseconds)
    spans: list[dict[str, Any]]  # the trace's complete events, read once for every figure


def _complete(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("ts"), int | float) and isinstance(e.get("dur"), int | float)]


def timelines(trace: dict[str, Any]) -> Timelines:
    spans = _complete(trace["traceEvents"])
    steps: dict[int, Interval] = {}
    main_tids = set()
    for e in spans:
        if (m := STEP_MARK.match(str(e.get("name", "")))) is not None:
            steps[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
            main_tids.add((e.get("pid"), e.get("tid")))
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if kernels:
        timeline = "device"
        comm_spans = [e for e in kernels if DEVICE_COMM.search(str(e.get("name", "")))]
        compute_spans = [e for e in kernels if not DEVICE_COMM.search(str(e.get("name", "")))]
        memcpy_spans = [e for e in spans if e.get("cat") in DEVICE_MEMORY]
    else:
        timeline = "host"
        comm_spans = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation")
                      and HOST_COMM.search(str(e.get("name", "")))]
        compute_spans = [e for e in spans if e.get("cat") == "cpu_op"
                         and (e.get("pid"), e.get("tid")) in main_tids
                         and not HOST_COMM.search(str(e.get("name", "")))]
        memcpy_spans = []

    def merged(es: list[dict[str, Any]]) -> list[Interval]:
        return union((e["ts"], e["ts"] + e["dur"]) for e in es)

    comm = merged(comm_spans)
    first_comm = {}
    for step, window in steps.items():
        inside = clip(comm, window)
        if inside:
            first_comm[step] = inside[0][0]
    base = trace.get("baseTimeNanoseconds")
    return Timelines(timeline=timeline, steps=steps, compute=merged(compute_spans), comm=comm,
                     memcpy=merged(memcpy_spans), first_comm=first_comm,
                     base_us=float(base) / 1e3 if isinstance(base, int | float) else 0.0,
                     spans=spans)


def breakdown(t: Timelines, window: Interval) -> dict[str, float | None]:
    """One window's split, in milliseconds, and the overlap share (None: no communication)."""
    compute, comm = clip(t.compute, window), clip(t.comm, window)
    memcpy = clip(t.memcpy, window)
    busy = union([*compute, *comm, *memcpy])
    both = length(intersection(compute, comm))
    comm_len, compute_len = length(comm), length(compute)
    exposed = comm_len - both
    memcpy_only = length(busy) - length(union([*compute, *comm]))
    total = window[1] - window[0]
    return {"window_ms": total / 1e3, "compute_ms": compute_len / 1e3,
            "comm_ms": comm_len / 1e3, "exposed_comm_ms": exposed / 1e3,
            "memcpy_ms": memcpy_only / 1e3, "idle_ms": (total - length(busy)) / 1e3,
            "overlap": both / comm_len if comm_len > 0 else None}


def top_operators(t: Timelines, limit: int = TOP_OPS) -> list[dict[str, Any]]:
    """The operators (host) or kernels (device) that took the most self time inside the
    traced steps."""
    spans, timeline = t.spans, t.timeline
    windows = union(t.steps.values())

    def inside(e: dict[str, Any]) -> bool:
        return any(s <= e["ts"] < end for s, end in windows)

    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if timeline == "device":
        for e in spans:
            if e.get("cat") == "kernel" and inside(e):
                totals[str(e["name"])][0] += 1
                totals[str(e["name"])][1] += e["dur"]
    else:
        by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for e in spans:
            if e.get("cat") in ("cpu_op", "user_annotation") and inside(e) \
                    and not STEP_MARK.match(str(e.get("name", ""))):
                by_thread[(e.get("pid"), e.get("tid"))].append(e)
        for events in by_thread.values():
            for name, self_us in self_times(events):
                totals[name][0] += 1
                totals[name][1] += self_us
    whole = sum(end - s for s, end in windows) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:limit]
    return [{"name": name, "calls": int(calls), "self_ms": us / 1e3, "share": us / whole}
            for name, (calls, us) in ranked]


def self_times(events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Each event's duration less its children's, for the events of one thread (nested by
    their times, as the profiler records them)."""
    ordered = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    out: list[tuple[str, float]] = []
    stack: list[tuple[float, int]] = []  # (end, index in out)
    for e in ordered:
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:  # the parent: its self time loses this child's duration
            parent = stack[-1][1]
            out[parent] = (out[parent][0], out[parent][1] - min(end, stack[-1][0]) + start)
        out.append((str(e.get("name", "")), float(e["dur"])))
        stack.append((end, len(out) - 1))
    return [(name, max(0.0, us)) for name, us in out]


def memory(trace: dict[str, Any], t0: float, points: int = MEMORY_POINTS
           ) -> dict[str, dict[str, Any]]:
    """Allocated memory over the capture, per device type: ``t_ms`` from ``t0`` and ``mib``
    (thinned to ``points`` by keeping each slice's largest value: a peak stays visible)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or e.get("name") != "[memory]" or e.get("ph") != "i":
            continue
        args = e.get("args") or {}
        total = args.get("Total Allocated")
        if not isinstance(total, int | float) or not isinstance(e.get("ts"), int | float):
            continue
        kind = args.get("Device Type")
        device = DEVICE_TYPES.get(kind, str(kind)) if isinstance(kind, int) else str(kind)
        series[device].append(((e["ts"] - t0) / 1e3, total / 2**20))
    out = {}
    for device, pts in series.items():
        pts.sort()
        size = max(1, -(-len(pts) // points))
        thin = [max(pts[i:i + size], key=lambda p: p[1]) for i in range(0, len(pts), size)]
        out[device] = {"t_ms": [round(t, 3) for t, _ in thin],
                       "mib": [round(m, 3) for _, m in thin],
                       "peak_mib": max(m for _, m in pts)}
    return out


# -- a capture ---------------------------------------------------------------------------------

def rank_report(rank: int, trace: dict[str, Any]) -> tuple[dict[str, Any], Timelines]:
    t = timelines(trace)
    if not t.steps:
        raise TraceError(f"rank {rank}'s trace holds no traced step (no traind.step# mark)")
    per_step = [{"step": step, **breakdown(t, window)}
                for step, window in sorted(t.steps.items())]
    whole: dict[str, float | None] = {k: sum(s[k] or 0.0 for s in per_step)
             for k in ("window_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "memcpy_ms",
                       "idle_ms")}
    comm, exposed = whole["comm_ms"] or 0.0, whole["exposed_comm_ms"] or 0.0
    whole["overlap"] = (comm - exposed) / comm if comm > 0 else None
    t0 = min(start for start, _ in t.steps.values())
    return {"rank": rank, "timeline": t.timeline, **whole, "steps": per_step,
            "top_ops": top_operators(t),
            "memory": memory(trace, t0)}, t


def straggler_view(lines: dict[int, Timelines], offsets: dict[int, float]
                   ) -> list[dict[str, Any]]:
    """Per step every rank saw: when each rank reached its first collective, in ms after the
    earliest (on the shared clock: a trace's unix time less its rank's clock offset), the
    last rank and the skew."""
    out = []
    steps = sorted(set.intersection(*(set(t.first_comm) for t in lines.values())))
    for step in steps:
        shared = {rank: (t.base_us + t.first_comm[step]) / 1e3 - 1e3 * offsets.get(rank, 0.0)
                  for rank, t in lines.items()}
        first = min(shared.values())
        arrivals = {rank: ms - first for rank, ms in sorted(shared.items())}
        last = max(arrivals, key=lambda r: arrivals[r])
        out.append({"step": step, "arrival_ms": arrivals, "last": last,
                    "skew_ms": arrivals[last]})
    return out


def report(traces: dict[int, dict[str, Any]], offsets: dict[int, float]) -> dict[str, Any]:
    """A capture's report from its ranks' traces (rank -> trace JSON) and clock offsets
    (rank -> seconds, trainer/clocksync.py)."""
    ranks, lines = [], {}
    for rank in sorted(traces):
        one, lines[rank] = rank_report(rank, traces[rank])
        ranks.append(one)
    straggler = straggler_view(lines, offsets) if len(lines) > 1 else []
    counts: dict[int, int] = defaultdict(int)
    for s in straggler:
        counts[s["last"]] += 1
    skews = sorted(s["skew_ms"] for s in straggler)
    return {"timeline": ranks[0]["timeline"] if ranks else "host",
            "steps": sorted({s["step"] for r in ranks for s in r["steps"]}),
            "ranks": ranks, "straggler": straggler,
            "last_counts": {str(r): n for r, n in sorted(counts.items())},
            "last_rank": max(counts, key=lambda r: counts[r]) if counts else None,
            "median_skew_ms": skews[len(skews) // 2] if skews else None}
