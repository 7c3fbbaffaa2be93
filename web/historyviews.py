"""Communication and hardware over time: the daemon's history snapshots to chart specs.

Pure, like :mod:`traind.web.nodeviews`: the routes hand over what ``NodeService.comm_history``
and ``hardware_history`` returned, and what is built here (which charts, their lines and
units, and which notice a page shows) is what static/history.js draws, unchanged. Times stay
unix seconds (the browser shows them in its own time zone); values are scaled here to the
unit the axis names, so there is one place where bytes become GiB/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from traind.daemon.service import GPU_SETTING, PROBE_SETTING, Setting
from traind.web.views import fmt_bytes, fmt_count, fmt_percent, fmt_seconds, fmt_size

GiB = 2**30
PERCENTILES = (("p50", "solid"), ("p95", "dash"), ("p99", "dot"))


@dataclass(frozen=True, slots=True)
class Chart:
    """One time-series chart: drawn into ``#chart-<key>`` by static/history.js."""

    key: str
    title: str
    note: str  # beside the title, muted
    unit: str  # the y axis' title
    traces: tuple[dict[str, Any], ...]  # {"name", "t": [unix s], "y": [...], "dash"?}
    log: bool = False  # a log y axis (latencies span microseconds to seconds)

    @property
    def spec(self) -> dict[str, Any]:
        """What history.js reads (the title and note are the page's, in HTML)."""
        return {"key": self.key, "unit": self.unit, "log": self.log,
                "traces": list(self.traces)}


@dataclass(frozen=True, slots=True)
class MeshView:
    """The Communication page's mesh section (a run with tp or pp beyond 1): formatted
    cells, rows in the order shown."""

    shape: str  # "dp 1 x tp 2 x pp 2"
    ranks: tuple[tuple[int, int, int, int], ...]  # (rank, dp, tp, pp)
    dims: tuple[tuple[str, str, str, str], ...]  # (mesh_dim, bytes, time, messages) a step
    stages: tuple[tuple[int, str, str, str, str, str, str, str], ...]
    # (stage, ranks, bubble, theory, busy, idle, sent forward, sent backward)


@dataclass(frozen=True, slots=True)
class CommHistoryView:
    run: int | None
    charts: tuple[Chart, ...]
    probe_off: Setting | None  # the probe's setting, when the run has no probe to chart
    slot_seconds: float
    mesh: MeshView | None = None


def mesh_view(mesh: dict[str, Any] | None) -> MeshView | None:
    """The mesh section's cells from CommHistory's ``mesh`` (daemon/ingest/mesh_history.py),
    None where the run has none."""
    if not mesh:
        return None
    shape = mesh["shape"]
    return MeshView(
        shape=" x ".join(f"{d} {shape[d]}" for d in ("dp", "tp", "pp")),
        ranks=tuple((r["rank"], r["dp"], r["tp"], r["pp"]) for r in mesh["ranks"]),
        dims=tuple((d["mesh_dim"], fmt_bytes(d["bytes_per_step"]),
                    fmt_seconds(d["seconds_per_step"]), fmt_count(d["calls_per_step"]))
                   for d in mesh["dims"]),
        stages=tuple((st["stage"], ", ".join(map(str, st["ranks"])),
                      fmt_percent(st["bubble"]), fmt_percent(st["bubble_theory"]),
                      fmt_seconds(st["busy_seconds"]), fmt_seconds(st["idle_seconds"]),
                      fmt_bytes(st["sent_forward_bytes"]), fmt_bytes(st["sent_backward_bytes"]))
                     for st in mesh["stages"]))


def _chart_key(name: str) -> str:
    """An element id's part for a line name ("all_gather (tp)" -> "all_gather-tp")."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", name).strip("-")


@dataclass(frozen=True, slots=True)
class HardwareHistoryView:
    charts: tuple[Chart, ...]
    samples: int
    sample_seconds: float
    gpu_off: Setting | None  # the GPU collector is switched off on this node
    gpu_absent: str | None  # NVML sees no GPU: why, "NVML: <its error>" (None: one is seen)


def _scaled(values: list[Any], factor: float) -> list[float | None]:
    return [None if v is None else v * factor for v in values]


def comm_history_view(history: dict[str, Any]) -> CommHistoryView:
    charts = [
        Chart(f"latency-{_chart_key(op['op'])}", f"{op['op']} latency",
              f"p50 · p95 · p99 per {history['slot_seconds']:.0f} s, all ranks and sizes",
              "latency (ms)",
              tuple({"name": name, "t": op["time"], "y": _scaled(op[name], 1e3), "dash": dash}
                    for name, dash in PERCENTILES),
              log=True)
        # The busiest op first: the gradient all-reduce, usually.
        for op in sorted(history["latency"], key=lambda op: -sum(op["calls"]))]
    if history["probe"]:
        one_op = len({p["op"] for p in history["probe"]}) == 1  # then the size names a line
        charts.append(Chart(
            "probe-busbw", "Bus bandwidth over time",
            "per message size, each probe" + (f" ({history['probe'][0]['op']})" if one_op else ""),
            "bus bandwidth (GiB/s)",
            tuple({"name": (fmt_size(p["size_bytes"]) if one_op
                            else f"{p['op']} {fmt_size(p['size_bytes'])}"), "t": p["time"],
                   "y": _scaled(p["bus_bandwidth"], 1 / GiB)} for p in history["probe"])))
    return CommHistoryView(run=history["run"], charts=tuple(charts),
                           probe_off=None if history["probe"] else PROBE_SETTING,
                           slot_seconds=history["slot_seconds"],
                           mesh=mesh_view(history.get("mesh")))


def _gpu_chart(h: dict[str, Any], key: str, title: str, unit: str,
               lines: tuple[tuple[str, str, float], ...]) -> Chart | None:
    """A chart with a line per GPU and ``lines`` entry (figure, label, scale); None when no
    GPU has any of the figures (a driver without NVLink counters, say)."""
    traces = tuple(
        {"name": f"GPU {g['gpu']}{label}", "t": h["time"], "y": _scaled(g[figure], scale),
         **({"dash": "dot"} if label.endswith("rx") else {})}
        for g in h["gpus"] for figure, label, scale in lines
        if any(v is not None for v in g[figure]))
    return Chart(key, title, "per GPU", unit, traces) if traces else None


def hardware_history_view(h: dict[str, Any]) -> HardwareHistoryView:
    total = h["memory_total"]
    charts: list[Chart | None] = [
        Chart("cpu", "CPU", "busy share, all cores", "CPU (%)",
              ({"name": "CPU", "t": h["time"], "y": _scaled(h["cpu"], 100)},)),
        Chart("memory", "Memory", f"used of {fmt_bytes(total)}" if total else "used",
              "memory (GiB)",
              ({"name": "used", "t": h["time"], "y": _scaled(h["memory_used"], 1 / GiB)},)),
    ]
    if h["gpus"]:
        charts += [
            _gpu_chart(h, "gpu-util", "GPU utilisation", "utilisation (%)",
                       (("utilization", "", 100),)),
            _gpu_chart(h, "gpu-power", "GPU power", "power (W)", (("power", "", 1),)),
            _gpu_chart(h, "gpu-pcie", "PCIe", "GiB/s",
                       (("pcie_tx", " tx", 1 / GiB), ("pcie_rx", " rx", 1 / GiB))),
            _gpu_chart(h, "gpu-nvlink", "NVLink", "GiB/s",
                       (("nvlink_tx", " tx", 1 / GiB), ("nvlink_rx", " rx", 1 / GiB))),
        ]
    seen = bool(h["gpu_devices"])
    return HardwareHistoryView(
        charts=tuple(c for c in charts if c is not None), samples=len(h["time"]),
        sample_seconds=h["sample_seconds"],
        gpu_off=None if h["gpu_collector"] else GPU_SETTING,
        gpu_absent=None if seen or not h["gpu_collector"] else (
            f"NVML: {h['gpu_absent']}" if h["gpu_absent"] else "NVML reports none"))
