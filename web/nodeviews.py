"""Metric samples to the Hardware and Communication pages: samples in, display rows out.

Pure, like :mod:`traind.web.views` (whose ``fmt_`` functions do the units): the routes ask the
service for :class:`MetricSample` lists and the templates only lay out what is built here, so
the grouping (by GPU, by method and rank, by message size) is tested without a server.
Series names and labels are those of ``traind.metrics.catalog``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traind.metrics.catalog import BY_NAME, MetricSpec
from traind.web.views import (
    DASH,
    bar_percent,
    fmt_bytes,
    fmt_celsius,
    fmt_count,
    fmt_factor,
    fmt_hertz,
    fmt_percent,
    fmt_rate,
    fmt_seconds,
    fmt_size,
    fmt_watts,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from traind.daemon.service import MetricSample

# Suffixes prometheus_client adds to a family's name in its samples (see catalog.MetricSpec).
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")
# A bar this full is shown in the warning colour: memory that will not fit one more batch.
WARN_AT = 90.0
# Clock-event reasons that are not a problem: an idle GPU drops its clocks on purpose.
BENIGN_THROTTLES = frozenset({"gpu_idle"})


def family_of(name: str) -> MetricSpec | None:
    """The catalog entry a sample belongs to (``..._total`` -> its counter), or None."""
    if name in BY_NAME:
        return BY_NAME[name]
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in BY_NAME:
            return BY_NAME[name.removesuffix(suffix)]
    return None


def metric_help(name: str) -> str:
    """The catalog's help text, for tooltips; "" for names it does not know."""
    spec = family_of(name)
    return spec.help if spec else ""


class Samples:
    """Samples indexed by name, looked up by a subset of their labels."""

    def __init__(self, samples: Iterable[MetricSample]) -> None:
        self._by_name: dict[str, list[MetricSample]] = defaultdict(list)
        for s in samples:
            self._by_name[s.name].append(s)

    def series(self, name: str, **labels: str) -> list[MetricSample]:
        return [
            s
            for s in self._by_name.get(name, ())
            if all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float | None:
        """The first matching series' value; None when there is none."""
        found = self.series(name, **labels)
        return found[0].value if found else None

    def total(self, name: str, **labels: str) -> float | None:
        """The sum over matching series (e.g. NVLink links of one GPU); None when none."""
        found = self.series(name, **labels)
        return sum(s.value for s in found) if found else None

    def label_values(self, name: str, label: str, **labels: str) -> list[str]:
        """Distinct values of ``label``, numbers in numeric order (gpu 10 after gpu 9)."""
        values = {s.labels[label] for s in self.series(name, **labels) if label in s.labels}
        return sorted(values, key=_natural)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _natural(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


@dataclass(frozen=True, slots=True)
class Meter:
    """A value with an optional bar: ``text`` is what is read, ``percent`` the bar's width."""

    text: str
    percent: float | None = None
    warn: bool = False


def meter(text: str, part: Any, whole: Any = 1.0, *, warn_at: float | None = WARN_AT) -> Meter:
    pct = bar_percent(part, whole)
    return Meter(text, pct, pct is not None and warn_at is not None and pct >= warn_at)


def _of(part: str, whole: str) -> str:
    return part if whole == DASH else f"{part} / {whole}"


# ---- hardware ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostView:
    cpu: Meter
    cpus: str
    load: str  # "1m · 5m · 15m"
    memory: Meter
    swap: Meter


@dataclass(frozen=True, slots=True)
class ProcessRow:
    role: str
    pid: str
    cpu: str
    rss: str
    threads: str
    fds: str


@dataclass(frozen=True, slots=True)
class DeviceRow:
    """A disk or a network interface: its name and cumulative counters since boot."""

    name: str
    cells: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Badge:
    text: str
    warn: bool


@dataclass(frozen=True, slots=True)
class GpuCard:
    index: str
    name: str
    utilization: Meter
    memory: Meter
    power: Meter
    temperatures: tuple[tuple[str, str], ...]  # (sensor, "54 °C")
    sm_clock: str
    memory_clock: str
    pcie: str  # "Gen 5 x16", plus "(max Gen 5 x16)" when the link trained below its best
    pcie_tx: str
    pcie_rx: str
    nvlink: str
    throttles: tuple[Badge, ...]


@dataclass(frozen=True, slots=True)
class HardwareView:
    host: HostView
    processes: tuple[ProcessRow, ...]
    gpu_count: int
    gpu_collector_failed: bool
    gpus: tuple[GpuCard, ...]
    disks: tuple[DeviceRow, ...]
    nics: tuple[DeviceRow, ...]


def host_view(s: Samples) -> HostView:
    h = "traind_host_"
    used, total = s.value(h + "memory_used_bytes"), s.value(h + "memory_total_bytes")
    swap_used, swap_total = s.value(h + "swap_used_bytes"), s.value(h + "swap_total_bytes")
    loads = [s.value(h + "load", window=w) for w in ("1m", "5m", "15m")]
    cpu = s.value(h + "cpu_usage_ratio")
    return HostView(
        # A busy CPU is the point of a training node: no warning colour for it.
        cpu=meter(fmt_percent(cpu), cpu, warn_at=None),
        cpus=fmt_count(s.value(h + "cpus")),
        load=DASH
        if all(v is None for v in loads)
        else " \u00b7 ".join(DASH if v is None else f"{v:.2f}" for v in loads),
        memory=meter(_of(fmt_bytes(used), fmt_bytes(total)), used, total),
        # No swap configured: show "none", not a bar of 0 over 0.
        swap=Meter("none")
        if swap_total == 0
        else meter(_of(fmt_bytes(swap_used), fmt_bytes(swap_total)), swap_used, swap_total),
    )


def process_rows(s: Samples) -> tuple[ProcessRow, ...]:
    p = "traind_process_"
    keys = {
        (x.labels.get("role", ""), x.labels.get("pid", ""))
        for name in ("cpu_seconds_total", "resident_memory_bytes")
        for x in s.series(p + name)
    }
    # The daemon first, then workers by pid (roughly the order they started).
    rows = sorted(keys, key=lambda k: (k[0] != "daemon", k[0], _natural(k[1])))
    return tuple(
        ProcessRow(
            role=role,
            pid=pid,
            cpu=fmt_seconds(s.value(p + "cpu_seconds_total", role=role, pid=pid)),
            rss=fmt_bytes(s.value(p + "resident_memory_bytes", role=role, pid=pid)),
            threads=fmt_count(s.value(p + "threads", role=role, pid=pid)),
            fds=fmt_count(s.value(p + "open_fds", role=role, pid=pid)),
        )
        for role, pid in rows
    )


def disk_rows(s: Samples) -> tuple[DeviceRow, ...]:
    h = "traind_host_disk_"
    return tuple(
        DeviceRow(
            dev,
            (
                fmt_bytes(s.value(h + "read_bytes_total", device=dev)),
                fmt_bytes(s.value(h + "written_bytes_total", device=dev)),
                fmt_count(s.value(h + "reads_total", device=dev)),
                fmt_count(s.value(h + "writes_total", device=dev)),
            ),
        )
        for dev in s.label_values(h + "read_bytes_total", "device")
    )


def nic_rows(s: Samples) -> tuple[DeviceRow, ...]:
    h = "traind_host_network_"
    return tuple(
        DeviceRow(
            nic,
            (
                fmt_bytes(s.value(h + "received_bytes_total", interface=nic)),
                fmt_bytes(s.value(h + "sent_bytes_total", interface=nic)),
                fmt_count(s.total(h + "errors_total", interface=nic)),
            ),
        )
        for nic in s.label_values(h + "received_bytes_total", "interface")
    )


def throttle_label(reason: str) -> str:
    """``sw_power_cap`` -> ``SW power cap``: NVML's reason names, readable."""
    words = reason.split("_")
    return " ".join(w.upper() if w in ("sw", "hw", "gpu") else w for w in words)


def gpu_card(s: Samples, gpu: str) -> GpuCard:
    g = "traind_gpu_"
    util = s.value(g + "utilization_ratio", gpu=gpu)
    used, total = (
        s.value(g + "memory_used_bytes", gpu=gpu),
        s.value(g + "memory_total_bytes", gpu=gpu),
    )
    power, limit = s.value(g + "power_watts", gpu=gpu), s.value(g + "power_limit_watts", gpu=gpu)
    gen, width = (
        s.value(g + "pcie_link_generation", gpu=gpu),
        s.value(g + "pcie_link_width", gpu=gpu),
    )
    max_gen, max_width = (
        s.value(g + "pcie_link_max_generation", gpu=gpu),
        s.value(g + "pcie_link_max_width", gpu=gpu),
    )
    links = s.total(g + "nvlink_active_links", gpu=gpu)  # per link 0/1, or already summed
    info = s.series(g + "info", gpu=gpu)
    return GpuCard(
        index=gpu,
        name=info[0].labels.get("name", "") if info else "",
        utilization=meter(fmt_percent(util), util, warn_at=None),
        memory=meter(_of(fmt_bytes(used), fmt_bytes(total)), used, total),
        # Drawing at the limit means the power cap, not the work, sets the clocks.
        power=meter(_of(fmt_watts(power), fmt_watts(limit)), power, limit, warn_at=98.0),
        temperatures=tuple(
            (sensor, fmt_celsius(s.value(g + "temperature_celsius", gpu=gpu, sensor=sensor)))
            for sensor in s.label_values(g + "temperature_celsius", "sensor", gpu=gpu)
        ),
        sm_clock=fmt_hertz(s.value(g + "clock_hertz", gpu=gpu, clock="sm")),
        memory_clock=fmt_hertz(s.value(g + "clock_hertz", gpu=gpu, clock="memory")),
        pcie=_pcie(gen, width, max_gen, max_width),
        pcie_tx=fmt_rate(s.value(g + "pcie_throughput_bytes_per_second", gpu=gpu, direction="tx")),
        pcie_rx=fmt_rate(s.value(g + "pcie_throughput_bytes_per_second", gpu=gpu, direction="rx")),
        nvlink=DASH if links is None else f"{links:.0f} up",
        throttles=tuple(
            Badge(throttle_label(x.labels["reason"]), x.labels["reason"] not in BENIGN_THROTTLES)
            for x in sorted(
                s.series(g + "throttle_reason", gpu=gpu), key=lambda x: x.labels.get("reason", "")
            )
            if x.value == 1 and "reason" in x.labels
        ),
    )


def _pcie(
    gen: float | None, width: float | None, max_gen: float | None, max_width: float | None
) -> str:
    if gen is None or width is None:
        return DASH
    text = f"Gen {gen:.0f} \u00d7{width:.0f}"
    # A link trained below its maximum (wrong slot, riser, power saving) is worth seeing.
    if max_gen is not None and max_width is not None and (gen, width) != (max_gen, max_width):
        text += f" (max Gen {max_gen:.0f} \u00d7{max_width:.0f})"
    return text


def hardware_view(samples: Iterable[MetricSample]) -> HardwareView:
    s = Samples(samples)
    devices = s.value("traind_gpu_devices")
    count = int(devices) if devices else 0
    ok = s.value("traind_gpu_collector_success")
    gpus = s.label_values("traind_gpu_info", "gpu") or s.label_values(
        "traind_gpu_utilization_ratio", "gpu"
    )
    return HardwareView(
        host=host_view(s),
        processes=process_rows(s),
        gpu_count=count,
        gpu_collector_failed=ok == 0,
        gpus=tuple(gpu_card(s, g) for g in gpus) if count else (),
        disks=disk_rows(s),
        nics=nic_rows(s),
    )


# ---- communication -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommRow:
    method: str
    rank: str
    raw: str
    sent: str
    ratio: str
    error: str
    hook: str
    allreduce: str
    buckets: str
    least_wait: bool  # the rank the others wait for: it arrives last, so it waits least


@dataclass(frozen=True, slots=True)
class ProbeTable:
    op: str
    ranks: tuple[str, ...]
    rows: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # size, ((latency, busbw), ...)


@dataclass(frozen=True, slots=True)
class CommView:
    run: str | None  # the run shown: the newest with communication series
    rows: tuple[CommRow, ...]
    probes: tuple[ProbeTable, ...]
    chart: list[dict[str, Any]]  # plotly traces: bus bandwidth (GiB/s) vs message size

    @property
    def empty(self) -> bool:
        return not self.rows and not self.probes


_COMM = "traind_comm_"
_BUSBW = _COMM + "probe_bus_bandwidth_bytes_per_second"
_LATENCY = _COMM + "probe_latency_seconds"


def comm_view(samples: Iterable[MetricSample]) -> CommView:
    s = Samples(samples)
    # Series stay exported after a run ends; the page is about the newest one.
    runs = {
        x.labels["run"]
        for name in (_COMM + "gradient_bytes_total", _BUSBW)
        for x in s.series(name)
        if "run" in x.labels
    }
    if not runs:
        return CommView(None, (), (), [])
    run = max(runs, key=_natural)
    return CommView(run, _comm_rows(s, run), _probe_tables(s, run), _chart(s, run))


def _comm_rows(s: Samples, run: str) -> tuple[CommRow, ...]:
    rows: list[CommRow] = []
    for method in s.label_values(_COMM + "gradient_bytes_total", "method", run=run):
        ranks = s.label_values(_COMM + "gradient_bytes_total", "rank", run=run, method=method)
        lab = [{"run": run, "rank": r, "method": method} for r in ranks]
        waits = [s.value(_COMM + "allreduce_seconds_total", **x) for x in lab]
        known = [w for w in waits if w is not None]
        # Only meaningful with someone to compare against, and only when they differ.
        least = min(known) if len(known) > 1 and min(known) < max(known) else None
        for x, wait in zip(lab, waits, strict=True):
            rows.append(
                CommRow(
                    method=method,
                    rank=x["rank"],
                    raw=fmt_bytes(s.value(_COMM + "gradient_bytes_total", **x)),
                    sent=fmt_bytes(s.value(_COMM + "sent_bytes_total", **x)),
                    ratio=fmt_factor(s.value(_COMM + "compression_ratio", **x)),
                    error=fmt_percent(s.value(_COMM + "compression_error_ratio", **x)),
                    hook=fmt_seconds(s.value(_COMM + "hook_seconds_total", **x)),
                    allreduce=fmt_seconds(wait),
                    buckets=fmt_count(s.value(_COMM + "buckets_total", **x)),
                    least_wait=least is not None and wait == least,
                )
            )
    return tuple(rows)


def _probe_tables(s: Samples, run: str) -> tuple[ProbeTable, ...]:
    tables = []
    for op in s.label_values(_BUSBW, "op", run=run):
        ranks = tuple(s.label_values(_BUSBW, "rank", run=run, op=op))
        sizes = s.label_values(_BUSBW, "size_bytes", run=run, op=op)
        rows = tuple(
            (
                fmt_size(_number(size)),
                tuple(
                    (
                        fmt_seconds(s.value(_LATENCY, run=run, op=op, rank=r, size_bytes=size)),
                        fmt_rate(s.value(_BUSBW, run=run, op=op, rank=r, size_bytes=size)),
                    )
                    for r in ranks
                ),
            )
            for size in sizes
        )
        tables.append(ProbeTable(op, ranks, rows))
    return tuple(tables)


def _chart(s: Samples, run: str) -> list[dict[str, Any]]:
    traces = []
    for op in s.label_values(_BUSBW, "op", run=run):
        for rank in s.label_values(_BUSBW, "rank", run=run, op=op):
            points = sorted(
                (size, x.value)
                for x in s.series(_BUSBW, run=run, op=op, rank=rank)
                if (size := _number(x.labels.get("size_bytes", ""))) is not None
            )
            traces.append(
                {
                    "name": f"{op} rank {rank}",
                    "x": [p[0] for p in points],
                    "y": [p[1] / 2**30 for p in points],  # GiB/s, as the table's fmt_rate
                    "text": [fmt_size(p[0]) for p in points],
                }
            )
    return traces
