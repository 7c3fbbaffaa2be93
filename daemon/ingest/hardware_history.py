"""The node's hardware over time: host CPU and memory, and each GPU's utilisation, power, PCIe
and NVLink traffic, sampled every :data:`SAMPLE_SECONDS` into a bounded ring buffer.

Hardware is read at scrape time (metrics/host.py, metrics/gpu.py) and nothing keeps what a
scrape saw; Prometheus and Grafana are the long-term store. The Hardware page wants the last
hour without them, so the node asks the same collectors every few seconds (:meth:`forever`)
and keeps a handful of their series here: the figures are the collectors' own (one home),
only NVLink's byte counter becomes a rate, between two samples (:func:`per_second`).

At most :data:`CAPACITY` samples (an hour at 5 s); with 8 GPUs a sample is ~70 floats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from prometheus_client.registry import Collector

log = logging.getLogger("traind")
SAMPLE_SECONDS = 5.0
CAPACITY = 720

# GPU figures kept, by the gauge they come from (traind_gpu_<key>): name -> (key, labels).
GPU_GAUGES: dict[str, tuple[str, dict[str, str]]] = {
    "utilization": ("utilization_ratio", {}),
    "memory_used": ("memory_used_bytes", {}),
    "power": ("power_watts", {}),
    "power_limit": ("power_limit_watts", {}),
    "pcie_tx": ("pcie_throughput_bytes_per_second", {"direction": "tx"}),
    "pcie_rx": ("pcie_throughput_bytes_per_second", {"direction": "rx"}),
}
# Counters summed over a GPU's links, kept as rates: name -> (key, direction).
GPU_RATES = {"nvlink_tx": ("nvlink_bytes_total", "tx"), "nvlink_rx": ("nvlink_bytes_total", "rx")}
GPU_FIGURES = (*GPU_GAUGES, *GPU_RATES)

Sample = tuple[str, dict[str, str], float]  # name (as exposed), labels, value


def per_second(before: float | None, after: float | None, seconds: float) -> float | None:
    """A counter's rate between two readings; None without both, or across a reset (the
    driver reloaded: the counter started again from zero)."""
    if before is None or after is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def pick(samples: Iterable[Sample]) -> dict[str, Any]:
    """The kept figures of one collection: host ``cpu`` (busy ratio), ``memory_used`` and
    ``memory_total`` (bytes), ``gpu_devices``, and per GPU index its gauges, name and the
    NVLink counters' totals (``counters``, turned into rates by :class:`HardwareHistory`)."""
    out: dict[str, Any] = {"cpu": None, "memory_used": None, "memory_total": None,
                           "gpu_devices": 0, "gpus": {}}
    host = {"traind_host_cpu_usage_ratio": "cpu", "traind_host_memory_used_bytes": "memory_used",
            "traind_host_memory_total_bytes": "memory_total"}
    gpus: dict[str, dict[str, Any]] = out["gpus"]

    def gpu(labels: dict[str, str]) -> dict[str, Any]:
        return gpus.setdefault(labels["gpu"], {"name": "", "counters": {}})

    for name, labels, value in samples:
        if name in host:
            out[host[name]] = value
        elif name == "traind_gpu_devices":
            out["gpu_devices"] = int(value)
        elif name == "traind_gpu_info" and "gpu" in labels:
            gpu(labels)["name"] = labels.get("name", "")
        elif name.startswith("traind_gpu_") and "gpu" in labels:
            key = name.removeprefix("traind_gpu_")
            for figure, (want, extra) in GPU_GAUGES.items():
                if key == want and all(labels.get(k) == v for k, v in extra.items()):
                    gpu(labels)[figure] = value
            for figure, (want, direction) in GPU_RATES.items():
                if key == want and labels.get("direction") == direction:
                    counters = gpu(labels)["counters"]
                    counters[figure] = counters.get(figure, 0.0) + value  # over its links
    return out


def read(collectors: Sequence[Collector]) -> list[Sample]:
    """Every sample of ``collectors`` (blocking: they read /proc, psutil and NVML)."""
    return [(s.name, dict(s.labels), s.value)
            for c in collectors for fam in c.collect() for s in fam.samples]


class HardwareHistory:
    """``record`` a collection (on the event loop); ``snapshot`` for the page and the API."""

    def __init__(self, collectors: Sequence[Collector], *, gpu_enabled: bool,
                 gpu_absent: Callable[[], str | None] = lambda: None,
                 capacity: int = CAPACITY, clock: Callable[[], float] = time.time) -> None:
        """``gpu_enabled``: whether the node runs the GPU collector (``metrics.gpu``);
        ``gpu_absent``: why NVML sees no GPU (its last error), for the page to say."""
        self._collectors, self._gpu_enabled, self._gpu_absent = collectors, gpu_enabled, gpu_absent
        self._clock = clock
        self._points: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._last: tuple[float, dict[str, dict[str, float]]] | None = None  # counters

    def record(self, picked: dict[str, Any], at: float | None = None) -> None:
        """Keep one :func:`pick` result, taken at unix time ``at`` (now if not given)."""
        at = self._clock() if at is None else at
        gpus = {}
        for index, g in picked["gpus"].items():
            counters = g.get("counters", {})
            before = self._last[1].get(index, {}) if self._last else {}
            dt = at - self._last[0] if self._last else 0.0
            gpus[index] = {"name": g.get("name", ""),
                           **{f: g.get(f) for f in GPU_GAUGES},
                           **{f: per_second(before.get(f), counters.get(f), dt)
                              for f in GPU_RATES}}
        self._last = (at, {i: g.get("counters", {}) for i, g in picked["gpus"].items()})
        self._points.append({"time": at, "cpu": picked["cpu"],
                             "memory_used": picked["memory_used"],
                             "memory_total": picked["memory_total"],
                             "gpu_devices": picked["gpu_devices"], "gpus": gpus})

    def sample(self) -> dict[str, Any]:
        """Read the collectors once (blocking: run it in a thread)."""
        return pick(read(self._collectors))

    async def forever(self, every: float = SAMPLE_SECONDS) -> None:
        """Sample every ``every`` seconds: read in a thread, recorded on the loop (where
        ``snapshot`` is read, so the two never race)."""
        while True:
            try:
                self.record(await asyncio.to_thread(self.sample))
            except Exception:  # a collector's bug must not end the sampling
                log.exception("hardware sample failed")
            await asyncio.sleep(every)

    def snapshot(self) -> dict[str, Any]:
        """Columns: ``time``, host ``cpu`` / ``memory_used`` / ``memory_total``, and per GPU
        seen in any sample its figures aligned with ``time`` (None where it had none)."""
        points = list(self._points)
        indexes = sorted({i for p in points for i in p["gpus"]}, key=_natural)
        last = points[-1] if points else None
        return {
            "sample_seconds": SAMPLE_SECONDS, "capacity": self._points.maxlen,
            "time": [p["time"] for p in points],
            "cpu": [p["cpu"] for p in points],
            "memory_used": [p["memory_used"] for p in points],
            "memory_total": last["memory_total"] if last else None,
            "gpu_collector": self._gpu_enabled,
            "gpu_devices": last["gpu_devices"] if last else 0,
            "gpu_absent": None if last and last["gpu_devices"] else self._gpu_absent(),
            "gpus": [{"gpu": i,
                      "name": next((p["gpus"][i]["name"] for p in reversed(points)
                                    if i in p["gpus"]), ""),
                      **{f: [p["gpus"].get(i, {}).get(f) for p in points] for f in GPU_FIGURES}}
                     for i in indexes],
        }


def _natural(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)
