"""The Hardware page's history: the collectors' figures sampled into a bounded buffer, NVLink's
byte counter as a rate, and a host without a GPU said so."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from traind.daemon.ingest.hardware_history import (
    HardwareHistory,
    per_second,
    pick,
    read,
)
from traind.metrics.host import HostCollector

GiB = 2**30


@pytest.mark.parametrize(
    ("before", "after", "seconds", "expected"),
    [(100.0, 600.0, 5.0, 100.0), (None, 600.0, 5.0, None), (100.0, None, 5.0, None),
     (600.0, 100.0, 5.0, None),  # a reset (driver reload): no rate, not a negative one
     (100.0, 600.0, 0.0, None)],
)
def test_per_second(before, after, seconds, expected):
    assert per_second(before, after, seconds) == expected


def gpu_node(nvlink: float, util: float = 0.9) -> list[tuple[str, dict[str, str], float]]:
    g = {"gpu": "0"}
    return [
        ("traind_host_cpu_usage_ratio", {}, 0.5),
        ("traind_host_memory_used_bytes", {}, 10 * GiB),
        ("traind_host_memory_total_bytes", {}, 64 * GiB),
        ("traind_host_cpu_seconds_total", {"mode": "user"}, 1e6),  # not kept
        ("traind_gpu_devices", {}, 1),
        ("traind_gpu_info", {**g, "name": "NVIDIA H100", "uuid": "GPU-1"}, 1),
        ("traind_gpu_utilization_ratio", g, util),
        ("traind_gpu_power_watts", g, 612.5),
        ("traind_gpu_power_limit_watts", g, 700),
        ("traind_gpu_memory_used_bytes", g, 40 * GiB),
        ("traind_gpu_pcie_throughput_bytes_per_second", {**g, "direction": "tx"}, 1e9),
        ("traind_gpu_pcie_throughput_bytes_per_second", {**g, "direction": "rx"}, 2e8),
        # Two links: the GPU's rate is their sum.
        *(("traind_gpu_nvlink_bytes_total", {**g, "link": str(k), "direction": d}, nvlink)
          for k in range(2) for d in ("tx", "rx")),
    ]


def test_pick_keeps_the_host_and_gpu_figures() -> None:
    p = pick(gpu_node(nvlink=1000.0))
    assert (p["cpu"], p["memory_used"], p["memory_total"], p["gpu_devices"]) == (
        0.5, 10 * GiB, 64 * GiB, 1)
    g = p["gpus"]["0"]
    assert g["name"] == "NVIDIA H100" and g["utilization"] == 0.9 and g["power"] == 612.5
    assert g["pcie_tx"] == 1e9 and g["pcie_rx"] == 2e8
    assert g["counters"] == {"nvlink_tx": 2000.0, "nvlink_rx": 2000.0}


def test_the_history_turns_nvlink_into_a_rate_and_is_bounded() -> None:
    h = HardwareHistory([], gpu_enabled=True, capacity=3)
    for i in range(4):
        h.record(pick(gpu_node(nvlink=1000.0 * (i + 1) ** 2, util=0.1 * i)), at=100.0 + 5 * i)
    snap = h.snapshot()
    assert snap["time"] == [105.0, 110.0, 115.0] and snap["cpu"] == [0.5] * 3
    assert snap["memory_total"] == 64 * GiB and snap["gpu_devices"] == 1
    assert snap["gpu_absent"] is None
    (g,) = snap["gpus"]
    assert g["gpu"] == "0" and g["name"] == "NVIDIA H100"
    assert g["utilization"] == pytest.approx([0.1, 0.2, 0.3])
    # Summed over 2 links: (2*4000 - 2*1000) / 5 s, then (2*9000 - 2*4000) / 5, ...
    assert g["nvlink_tx"] == [1200.0, 2000.0, 2800.0]
    assert g["power_limit"] == [700] * 3


def test_no_gpu_the_history_says_why_and_keeps_the_host() -> None:
    h = HardwareHistory([], gpu_enabled=True, gpu_absent=lambda: "NVML Shared Library Not Found")
    assert h.snapshot()["time"] == [] and h.snapshot()["gpus"] == []
    h.record(pick([("traind_host_cpu_usage_ratio", {}, 0.25), ("traind_gpu_devices", {}, 0)]),
             at=1.0)
    snap = h.snapshot()
    assert snap["cpu"] == [0.25] and snap["gpus"] == [] and snap["gpu_devices"] == 0
    assert snap["gpu_absent"] == "NVML Shared Library Not Found"
    assert snap["gpu_collector"] is True
    assert HardwareHistory([], gpu_enabled=False).snapshot()["gpu_collector"] is False


class _Fixed:
    def collect(self):  # type: ignore[no-untyped-def]
        yield GaugeMetricFamily("traind_host_cpu_usage_ratio", "", value=0.75)
        c = CounterMetricFamily("traind_gpu_nvlink_bytes", "", labels=["gpu", "direction"])
        c.add_metric(["0", "tx"], 10.0)
        yield c


def test_read_flattens_the_collectors_as_exposed() -> None:
    assert read([_Fixed()]) == [  # type: ignore[list-item]
        ("traind_host_cpu_usage_ratio", {}, 0.75),
        ("traind_gpu_nvlink_bytes_total", {"gpu": "0", "direction": "tx"}, 10.0)]


def test_sampling_the_real_host_collector_forever_records_on_the_loop() -> None:
    h = HardwareHistory([HostCollector(lambda: [], usable_cpus=lambda: 2)], gpu_enabled=False)

    async def main() -> None:
        task = asyncio.create_task(h.forever(every=0.01))
        while len(h.snapshot()["time"]) < 2:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    snap = h.snapshot()
    assert 0 <= snap["cpu"][-1] <= 1 and snap["memory_used"][-1] > 0
    assert snap["memory_total"] > snap["memory_used"][-1]
