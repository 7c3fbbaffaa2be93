"""GPU samples to Prometheus families: a catalog and one pure function, tested without NVML.

Every per-GPU family is labelled ``gpu`` (the NVML index) and nothing free-form; the uuid,
model name, PCI bus id and node live only on ``traind_gpu_info`` (value 1) for joins.
NVLink families carry ``link`` when per-link export is on; with it off the same family names
hold the per-GPU sum (links up, bytes, errors), so ``sum by (gpu)`` queries work either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from traind.metrics.gpu_read import GpuSample, Key

PREFIX = "traind_gpu_"


@dataclass(frozen=True, slots=True)
class Family:
    counter: bool
    help: str
    labels: tuple[str, ...] = ()  # beside gpu (and link)


def _g(help: str, *labels: str) -> Family:
    return Family(False, help, labels)


def _c(help: str, *labels: str) -> Family:
    return Family(True, help, labels)


# key -> family; the exposed name is PREFIX + key (+ "_total" for counters).
GPU_FAMILIES: dict[str, Family] = {
    "utilization_ratio": _g("Share of the last sample period a kernel was running (0-1)."),
    "memory_utilization_ratio": _g("Share of the last sample period device memory was being "
                                   "read or written (0-1)."),
    "memory_used_bytes": _g("Device memory allocated."),
    "memory_free_bytes": _g("Device memory free."),
    "memory_total_bytes": _g("Device memory installed."),
    "memory_reserved_bytes": _g("Device memory reserved by the driver and firmware."),
    "power_watts": _g("Power draw."),
    "power_limit_watts": _g("Enforced power limit."),
    "energy_joules": _c("Energy used since the driver loaded."),
    "temperature_celsius": _g("Temperature by sensor (gpu die, memory = HBM).", "sensor"),
    "clock_hertz": _g("Current clock.", "clock"),
    "clock_max_hertz": _g("Highest clock the GPU can run at.", "clock"),
    "throttle_reason": _g("1 while this clock-event (throttle) reason holds clocks down, "
                          "else 0.", "reason"),
    "throttle_seconds": _c("Time clocks were held below target by this policy.", "policy"),
    "pcie_throughput_bytes_per_second": _g("PCIe traffic as NVML samples it (GPM devices: "
                                           "averaged since the previous scrape).",
                                           "direction"),
    "pcie_bytes": _c("PCIe bytes moved.", "direction"),
    "pcie_link_generation": _g("PCIe link generation in use."),
    "pcie_link_max_generation": _g("Highest PCIe generation the GPU and slot support."),
    "pcie_link_width": _g("PCIe lanes in use."),
    "pcie_link_max_width": _g("Most PCIe lanes the GPU and slot support."),
    "pcie_replays": _c("PCIe replays (link-level retransmissions)."),
    "ecc_errors": _c("ECC errors; volatile since the driver loaded, aggregate for the "
                     "GPU's life.", "type", "scope"),
    "remapped_rows": _g("Memory rows remapped, by the error class that caused it.", "cause"),
    "row_remap_pending": _g("1 if a row remap waits for a GPU reset."),
    "row_remap_failed": _g("1 if a row remap failed (the GPU needs service)."),
    "xid_errors": _c("XID critical-error events seen since the collector started."),
    "last_xid": _g("Code of the latest XID event (0: none since the collector started)."),
    "graphics_active_ratio": _g("GPM: share of time any graphics/compute engine was active "
                                "since the previous scrape (0-1)."),
    "sm_active_ratio": _g("GPM: share of SMs busy since the previous scrape (0-1)."),
    "sm_occupancy_ratio": _g("GPM: resident warps over the maximum since the previous "
                             "scrape (0-1)."),
    "dram_bandwidth_ratio": _g("GPM: DRAM bandwidth used over peak since the previous scrape "
                               "(0-1)."),
    "pipe_active_ratio": _g("GPM: share of time SMs used this pipe since the previous "
                            "scrape (0-1).", "pipe"),
}
LINK_FAMILIES: dict[str, Family] = {
    "nvlink_active_links": _g("NVLinks up (per link: 1 up, 0 down)."),
    "nvlink_bytes": _c("NVLink data bytes (payload, without protocol overhead).",
                       "direction"),
    "nvlink_errors": _c("NVLink data-link errors by kind.", "type"),
}


def _family(key: str, fam: Family,
            labels: Sequence[str]) -> CounterMetricFamily | GaugeMetricFamily:
    cls = CounterMetricFamily if fam.counter else GaugeMetricFamily
    return cls(PREFIX + key, fam.help, labels=[*labels, *fam.labels])


def shape(samples: Iterable[GpuSample], *, per_link: bool, node: str) -> list[Metric]:
    """The info family and every family with at least one series, in catalog order."""
    samples = sorted(samples, key=lambda s: s.info.index)
    info = GaugeMetricFamily(PREFIX + "info", "GPU identity; join on gpu for names.",
                             labels=["gpu", "uuid", "name", "pci_bus_id", "node"])
    gpu = {key: _family(key, fam, ["gpu"]) for key, fam in GPU_FAMILIES.items()}
    link_labels = ["gpu", "link"] if per_link else ["gpu"]
    link = {key: _family(key, fam, link_labels) for key, fam in LINK_FAMILIES.items()}
    for s in samples:
        g = str(s.info.index)
        info.add_metric([g, s.info.uuid, s.info.name, s.info.pci_bus_id, node], 1.0)
        for (key, labels), value in s.values.items():
            gpu[key].add_metric([g, *labels], value)
        if per_link:
            for i, values in enumerate(s.links):
                for (key, labels), value in values.items():
                    link[key].add_metric([g, str(i), *labels], value)
        else:
            for (key, labels), value in _sum_links(s.links).items():
                link[key].add_metric([g, *labels], value)
    return [info, *(f for f in (*gpu.values(), *link.values()) if f.samples)]


def _sum_links(links: Iterable[Mapping[Key, float]]) -> dict[Key, float]:
    total: dict[Key, float] = {}
    for values in links:
        for key, value in values.items():
            total[key] = total.get(key, 0.0) + value
    return total
