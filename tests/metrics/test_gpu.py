"""The GPU collector against this host (no NVIDIA: "no device", cleanly) and against a
modeled 8-GPU H100 SXM node served by a fake NVML built from pynvml's own ctypes structs and
exception classes (fixtures/h100_sxm_8gpu.json)."""

from __future__ import annotations

import ctypes
import inspect
import json
import logging
import os
import shutil
import subprocess
from collections import deque
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pynvml as N
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from traind.metrics.catalog import CATALOG
from traind.metrics.gpu import GpuCollector
from traind.metrics.gpu_read import DeviceInfo, GpuSample
from traind.metrics.gpu_shape import GPU_FAMILIES, LINK_FAMILIES, shape

if TYPE_CHECKING:
    from collections.abc import Iterable

FIXTURE = Path(__file__).parent / "fixtures" / "h100_sxm_8gpu.json"
MEMBER = {"uint": (N.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal"),
          "ull": (N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal")}
LINK_SCOPED = {N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}
ERROR_NAME = {N.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", N.NVML_NVLINK_ERROR_DL_CRC_DATA:
              "crc_data", N.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
              N.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery"}


class FakeNvml:
    """The node's recorded answers behind pynvml's function names and return types.

    ``unsupported`` holds (function name, gpu) pairs, or ("field:<id>", gpu) for one field
    value, that answer NVMLError_NotSupported; ``broken`` maps such pairs to an exception.
    """

    def __init__(self, node: dict[str, Any], *, unsupported: Iterable[tuple[str, int]] = (),
                 broken: dict[tuple[str, int], Exception] | None = None,
                 init_error: Exception | None = None) -> None:
        self.gpus = node["gpus"]
        self.unsupported, self.broken = set(unsupported), dict(broken or {})
        self.init_error = init_error
        self.events = deque(node["xid_events"])
        self.handles = [ctypes.cast(ctypes.c_void_p(0x7F00_0000 + 0x1000 * g["index"]),
                                    N.c_nvmlDevice_t) for g in self.gpus]
        self.registered: set[int] = set()
        self.gpm_taken: dict[int, int] = {}  # sample address -> gpu
        self.gpm_live: set[int] = set()
        self.inits = self.shutdowns = 0

    # -- plumbing ---------------------------------------------------------------------------
    def _gpu(self, handle: Any, fn: str) -> dict[str, Any]:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        index = next(i for i, h in enumerate(self.handles)
                     if ctypes.cast(h, ctypes.c_void_p).value == addr)
        if (fn, index) in self.broken:
            raise self.broken[(fn, index)]
        if (fn, index) in self.unsupported:
            raise N.NVMLError(N.NVML_ERROR_NOT_SUPPORTED)
        return self.gpus[index]

    # -- library and devices ----------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.handles[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._gpu(handle, "nvmlDeviceGetUUID")["uuid"])

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return str(self._gpu(handle, "nvmlDeviceGetName")["name"])

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        g = self._gpu(handle, "nvmlDeviceGetPciInfo")
        info = N.nvmlPciInfo_t()
        info.busId = g["pci_bus_id"].encode()
        info.bus = int(g["pci_bus_id"].split(":")[1], 16)
        return info

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        g = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (N.c_nvmlFieldValue_t * len(fieldIds))()
        for fv, fid in zip(values, fieldIds, strict=True):
            fv.fieldId, fv.scopeId = fid if isinstance(fid, tuple) else (fid, 0)
            source = g["links"][fv.scopeId]["fields"] if fv.fieldId in LINK_SCOPED \
                else g["fields"]
            recorded = source.get(str(fv.fieldId))
            if recorded is None or (f"field:{fv.fieldId}", g["index"]) in self.unsupported:
                fv.nvmlReturn = N.NVML_ERROR_NOT_SUPPORTED
                continue
            kind, value = recorded
            fv.valueType, member = MEMBER[kind]
            setattr(fv.value, member, value)
            fv.nvmlReturn, fv.latencyUsec = N.NVML_SUCCESS, 3
        return values

    def nvmlDeviceGetSupportedClocksEventReasons(self, handle: Any) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetSupportedClocksEventReasons")
                   ["supported_clock_event_reasons"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")
                   ["clock_event_reasons"])

    # -- GPM ----------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        support = N.c_nvmlGpmSupport_t()
        support.version = N.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = self._gpu(device, "nvmlGpmQueryDeviceSupport")[
            "gpm_supported"]
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        sample = ctypes.cast(ctypes.pointer(N.struct_c_nvmlGpmSample_t()), N.c_nvmlGpmSample_t)
        self._keep = [*getattr(self, "_keep", []), sample]  # the struct must outlive the test
        self.gpm_live.add(ctypes.addressof(sample.contents))
        return sample

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self.gpm_live.discard(ctypes.addressof(gpmSample.contents))

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        g = self._gpu(device, "nvmlGpmSampleGet")
        self.gpm_taken[ctypes.addressof(gpmSample.contents)] = g["index"]
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        first = self.gpm_taken[ctypes.addressof(metricsGet.sample1.contents)]
        second = self.gpm_taken[ctypes.addressof(metricsGet.sample2.contents)]
        assert first == second and metricsGet.version == N.NVML_GPM_METRICS_GET_VERSION
        g = self.gpus[second]
        for i in range(metricsGet.numMetrics):
            m = metricsGet.metrics[i]
            value = g["gpm_percent"].get(str(m.metricId))
            m.nvmlReturn = N.NVML_ERROR_NOT_SUPPORTED if value is None else N.NVML_SUCCESS
            m.value = value or 0.0
        return metricsGet

    # -- events -------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> Any:
        return N.c_nvmlEventSet_t()

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        self.registered.add(self._gpu(handle, "nvmlDeviceRegisterEvents")["index"])

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        while self.events:
            ev = self.events.popleft()
            if ev["gpu"] in self.registered:
                data = N.c_nvmlEventData_t()
                # A fresh pointer object, as NVML returns: only the address matches.
                data.device = ctypes.cast(ctypes.cast(self.handles[ev["gpu"]], ctypes.c_void_p),
                                          N.c_nvmlDevice_t)
                data.eventType, data.eventData = N.nvmlEventTypeXidCriticalError, ev["xid"]
                return data
        raise N.NVMLError(N.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self.event_set_freed = True

    # -- per-scrape readings ------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        u = self._gpu(handle, "nvmlDeviceGetUtilizationRates")["utilization"]
        return N.c_nvmlUtilization_t(gpu=u["gpu"], memory=u["memory"])

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        m = self._gpu(handle, "nvmlDeviceGetMemoryInfo")["memory"]
        if not version:
            return N.c_nvmlMemory_t(total=m["total"], free=m["free"], used=m["used"])
        return N.c_nvmlMemory_v2_t(version=version, total=m["total"], reserved=m["reserved"],
                                   free=m["free"], used=m["used"])

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetPowerUsage")["power_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit")["power_limit_mw"])

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")["energy_mj"])

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int,
                                  version: int = N.nvmlTemperature_v1) -> int:
        assert sensor == N.NVML_TEMPERATURE_GPU
        return int(self._gpu(handle, "nvmlDeviceGetTemperatureV")["temperature_gpu"])

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        clocks = self._gpu(handle, "nvmlDeviceGetClockInfo")["clocks_mhz"]
        return int(clocks["sm" if type == N.NVML_CLOCK_SM else "mem"])

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        clocks = self._gpu(handle, "nvmlDeviceGetMaxClockInfo")["max_clocks_mhz"]
        return int(clocks["sm" if type == N.NVML_CLOCK_SM else "mem"])

    def nvmlDeviceGetViolationStatus(self, device: Any, perfPolicyType: int) -> Any:
        ns = self._gpu(device, "nvmlDeviceGetViolationStatus")["violation_ns"]
        return N.c_nvmlViolationTime_t(referenceTime=1_700_000_000_000_000,
                                       violationTime=ns[str(perfPolicyType)])

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        kbps = self._gpu(device, "nvmlDeviceGetPcieThroughput")["pcie_kbps"]
        return int(kbps["tx" if counter == N.NVML_PCIE_UTIL_TX_BYTES else "rx"])

    def _pcie(self, handle: Any, fn: str, key: str) -> int:
        return int(self._gpu(handle, fn)["pcie"][key])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration", "gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration", "max_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth", "width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth", "max_width")

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetPcieReplayCounter", "replay")

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        return int(self._gpu(device, "nvmlDeviceGetNvLinkState")["links"][link]["state"])

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        g = self._gpu(device, "nvmlDeviceGetNvLinkErrorCounter")
        return int(g["links"][link]["errors"][ERROR_NAME[counter]])


@pytest.fixture(scope="module")
def node() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def scrape(collector: GpuCollector, times: int = 1) -> tuple[CollectorRegistry, str]:
    reg = CollectorRegistry()
    reg.register(collector)
    text = ""
    for _ in range(times):
        text = generate_latest(reg).decode()
    return reg, text


def series(reg: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items())))
            for fam in reg.collect() for s in fam.samples}


def exposition_series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


Series = tuple[str, tuple[tuple[str, str], ...]]
TX_RX = ("tx", "rx")
# What the fixture's H100s answer for each label beside gpu and link, per family: every
# clock-event reason is in their supported mask, GPM is on, every link answers every field.
OTHER_LABELS: dict[str, dict[str, tuple[str, ...]]] = {
    "traind_gpu_temperature_celsius": {"sensor": ("gpu", "memory")},
    "traind_gpu_clock_hertz": {"clock": ("sm", "memory")},
    "traind_gpu_clock_max_hertz": {"clock": ("sm", "memory")},
    "traind_gpu_throttle_reason": {"reason": (
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
        "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
        "display_clock_setting")},
    "traind_gpu_throttle_seconds": {"policy": (
        "power", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability",
        "total_app_clocks", "total_base_clocks")},
    "traind_gpu_pcie_throughput_bytes_per_second": {"direction": TX_RX},
    "traind_gpu_pcie_bytes": {"direction": TX_RX},
    "traind_gpu_ecc_errors": {"type": ("corrected", "uncorrected"),
                              "scope": ("volatile", "aggregate")},
    "traind_gpu_remapped_rows": {"cause": ("correctable", "uncorrectable")},
    "traind_gpu_pipe_active_ratio": {"pipe": (
        "tensor", "tensor_hmma", "tensor_imma", "tensor_dfma", "fp64", "fp32", "fp16",
        "integer")},
    "traind_gpu_nvlink_bytes": {"direction": TX_RX},
    "traind_gpu_nvlink_errors": {"type": ("crc_flit", "crc_data", "replay", "recovery")},
}


def expected_series(node: dict[str, Any], *, per_link: bool, name: str = "") -> set[Series]:
    """Every series the GPU collector owes a scrape of the fixture node: each family the
    catalog (metrics/catalog.py) gives the collector, for each GPU, for each of its NVLinks
    (up or down: a down link reads 0) where the family is per link, for each value of its
    other labels. The families come from the catalog, so one the collector drops is missed."""
    out: set[Series] = set()
    for spec in (m for m in CATALOG if m.source == "gpu"):
        if spec.name == "traind_gpu_info":
            out |= {(spec.exposed, tuple(sorted({
                "gpu": str(g["index"]), "uuid": g["uuid"], "name": g["name"],
                "pci_bus_id": g["pci_bus_id"], "node": name}.items()))) for g in node["gpus"]}
            continue
        if not spec.labels:  # the node's own: devices, success, duration, unsupported
            out.add((spec.exposed, ()))
            continue
        other = OTHER_LABELS.get(spec.name, {})
        assert ("gpu", *(("link",) if "link" in spec.labels else ()), *other) == spec.labels, (
            f"{spec.name}: OTHER_LABELS does not say which values its labels take")
        for g in node["gpus"]:
            links: list[dict[str, str]] = [{}]
            if "link" in spec.labels and per_link:
                links = [{"link": str(i)} for i in range(len(g["links"]))]
            for link, values in product(links, product(*other.values())):
                labels = {"gpu": str(g["index"]), **link, **dict(zip(other, values, strict=True))}
                out.add((spec.exposed, tuple(sorted(labels.items()))))
    return out


def assert_series(got: set[Series], want: set[Series]) -> None:
    missing, extra = sorted(want - got), sorted(got - want)
    assert not missing and not extra, (
        f"{len(missing)} missing, first {missing[:8]}; {len(extra)} unexpected, first {extra[:8]}")


# -- this host: no NVIDIA -----------------------------------------------------------------------

def test_this_host_reports_no_device_once_and_nothing_else(caplog: pytest.LogCaptureFixture):
    try:
        N.nvmlInit()
    except N.NVMLError:
        pass
    else:
        N.nvmlShutdown()
        pytest.skip("this host has an NVIDIA driver; the no-device path needs one without")
    caplog.set_level(logging.INFO, logger="traind.metrics.gpu")
    reg = CollectorRegistry()
    reg.register(GpuCollector())
    for _ in range(4):
        text = generate_latest(reg).decode()
    names = {name for name, _ in series(reg)}
    assert names == {"traind_gpu_devices", "traind_gpu_collector_success",
                     "traind_gpu_collector_duration_seconds"}, text
    assert reg.get_sample_value("traind_gpu_devices") == 0
    assert reg.get_sample_value("traind_gpu_collector_success") == 1
    said = [r for r in caplog.records if "no NVIDIA device" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said


def test_nvml_init_is_retried_at_most_once_per_interval(node: dict[str, Any],
                                                        caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="traind.metrics.gpu")
    now = [1000.0]
    fake = FakeNvml(node, init_error=N.NVMLError(N.NVML_ERROR_DRIVER_NOT_LOADED))
    collector = GpuCollector(fake, retry_s=300, clock=lambda: now[0])
    assert collector.absent_reason is None  # not tried yet
    reg, _ = scrape(collector, times=5)
    assert fake.inits == 1
    assert collector.absent_reason == "Driver Not Loaded"  # what the Hardware page says
    now[0] += 299
    generate_latest(reg)
    assert fake.inits == 1
    now[0] += 2
    fake.init_error = None  # the driver came back: the next try finds the GPUs
    generate_latest(reg)
    assert fake.inits == 2
    assert reg.get_sample_value("traind_gpu_devices") == 8
    assert collector.absent_reason is None
    assert reg.get_sample_value("traind_gpu_collector_success") == 1
    said = [r.getMessage() for r in caplog.records if "no NVIDIA device" in r.getMessage()]
    assert said == ["no NVIDIA device: Driver Not Loaded"]


def test_nvml_present_but_failing_is_an_error_not_no_device(node: dict[str, Any]):
    now = [0.0]
    fake = FakeNvml(node, broken={("nvmlDeviceGetUUID", 4): N.NVMLError(N.NVML_ERROR_GPU_IS_LOST)})
    reg, _ = scrape(GpuCollector(fake, retry_s=60, clock=lambda: now[0]), times=3)
    assert reg.get_sample_value("traind_gpu_collector_success") == 0
    assert reg.get_sample_value("traind_gpu_devices") == 0
    assert fake.inits == 1 and fake.shutdowns == 1  # NVML released, not retried every scrape
    fake.broken.clear()
    now[0] = 61
    assert reg.get_sample_value("traind_gpu_collector_success") == 1
    assert reg.get_sample_value("traind_gpu_devices") == 8


# -- the modeled 8-GPU H100 node -----------------------------------------------------------------

def test_an_8_gpu_hopper_node_exports_every_family_per_gpu_and_per_link(node: dict[str, Any]):
    full, text = scrape(GpuCollector(FakeNvml(node), node="hgx-01"), times=2)
    folded, folded_text = scrape(GpuCollector(FakeNvml(node), per_link=False, node="hgx-01"),
                                 times=2)
    # Exactly the catalog's families: each on every GPU, the NVLink ones on each of its 18
    # links (per_link) or summed per GPU (per_link=false).
    assert_series(series(full), expected_series(node, per_link=True, name="hgx-01"))
    assert_series(series(folded), expected_series(node, per_link=False, name="hgx-01"))
    n_full, n_folded = len(series(full)), len(series(folded))
    assert exposition_series(text) == n_full and exposition_series(folded_text) == n_folded
    # The figure README.md quotes for this modelled node (its NVML answers hand-written).
    print(f"\n8x H100 (modelled): {n_full} series with per_link, {n_folded} without "
          f"({n_full - n_folded} fewer)")
    assert full.get_sample_value("traind_gpu_collector_success") == 1
    assert full.get_sample_value("traind_gpu_collector_unsupported_fields") == 0
    # Folded, the same family names hold per-GPU sums.
    assert folded.get_sample_value("traind_gpu_nvlink_active_links", {"gpu": "7"}) == 17
    assert folded.get_sample_value("traind_gpu_nvlink_errors_total",
                                   {"gpu": "4", "type": "replay"}) == 12


def test_per_gpu_values_land_on_their_gpu_label(node: dict[str, Any]):
    reg, _ = scrape(GpuCollector(FakeNvml(node), node="hgx-01"))
    get = reg.get_sample_value
    for g in node["gpus"]:
        lab = {"gpu": str(g["index"])}
        assert get("traind_gpu_info", {**lab, "uuid": g["uuid"], "name": g["name"],
                                       "pci_bus_id": g["pci_bus_id"], "node": "hgx-01"}) == 1
        assert get("traind_gpu_power_watts", lab) == pytest.approx(g["power_mw"] / 1000)
        assert get("traind_gpu_energy_joules_total", lab) == pytest.approx(g["energy_mj"] / 1e3)
        assert get("traind_gpu_memory_used_bytes", lab) == g["memory"]["used"]
        assert get("traind_gpu_memory_reserved_bytes", lab) == g["memory"]["reserved"]
        assert get("traind_gpu_utilization_ratio", lab) == pytest.approx(
            g["utilization"]["gpu"] / 100)
        assert get("traind_gpu_clock_hertz", {**lab, "clock": "sm"}) == \
            g["clocks_mhz"]["sm"] * 1e6
        assert get("traind_gpu_temperature_celsius", {**lab, "sensor": "memory"}) == 60 + g[
            "index"]
        assert get("traind_gpu_pcie_link_generation", lab) == 5
        assert get("traind_gpu_pcie_link_width", lab) == 16
        assert get("traind_gpu_throttle_seconds_total", {**lab, "policy": "power"}) == \
            pytest.approx(g["index"] + 1)
    assert get("traind_gpu_throttle_reason", {"gpu": "3", "reason": "sw_power_cap"}) == 1
    assert get("traind_gpu_throttle_reason", {"gpu": "4", "reason": "sw_power_cap"}) == 0
    assert get("traind_gpu_throttle_reason", {"gpu": "5", "reason": "hw_thermal_slowdown"}) == 1
    assert get("traind_gpu_xid_errors_total", {"gpu": "2"}) == 1
    assert get("traind_gpu_last_xid", {"gpu": "2"}) == 94
    assert get("traind_gpu_xid_errors_total", {"gpu": "3"}) == 0
    assert get("traind_gpu_ecc_errors_total", {"gpu": "2", "type": "corrected",
                                               "scope": "aggregate"}) == 17
    assert get("traind_gpu_remapped_rows", {"gpu": "2", "cause": "correctable"}) == 1
    assert get("traind_gpu_nvlink_active_links", {"gpu": "7", "link": "17"}) == 0
    assert get("traind_gpu_nvlink_active_links", {"gpu": "7", "link": "16"}) == 1
    assert get("traind_gpu_nvlink_errors_total", {"gpu": "4", "link": "9",
                                                  "type": "crc_flit"}) == 3
    tx_kib = node["gpus"][6]["links"][5]["fields"][str(N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)]
    assert get("traind_gpu_nvlink_bytes_total", {"gpu": "6", "link": "5",
                                                 "direction": "tx"}) == tx_kib[1] * 1024


def test_not_supported_on_one_gpu_drops_only_that_series(node: dict[str, Any]):
    fake = FakeNvml(node, unsupported={("nvmlDeviceGetPowerUsage", 3),
                                       (f"field:{N.NVML_FI_DEV_MEMORY_TEMP}", 5)})
    reg, _ = scrape(GpuCollector(fake))
    get = reg.get_sample_value
    assert get("traind_gpu_collector_success") == 1
    assert get("traind_gpu_collector_unsupported_fields") == 2
    assert get("traind_gpu_power_watts", {"gpu": "3"}) is None
    assert all(get("traind_gpu_power_watts", {"gpu": str(i)}) for i in (0, 1, 2, 4, 5, 6, 7))
    assert get("traind_gpu_temperature_celsius", {"gpu": "5", "sensor": "memory"}) is None
    assert get("traind_gpu_temperature_celsius", {"gpu": "5", "sensor": "gpu"}) == 60
    assert get("traind_gpu_power_limit_watts", {"gpu": "3"}) == 700


def test_an_unexpected_failure_sets_success_0_and_the_rest_still_exports(
        node: dict[str, Any], caplog: pytest.LogCaptureFixture):
    fake = FakeNvml(node, broken={
        ("nvmlDeviceGetClockInfo", 1): N.NVMLError(N.NVML_ERROR_UNKNOWN),
        ("nvmlDeviceGetNvLinkState", 6): RuntimeError("driver hiccup")})
    reg, text = scrape(GpuCollector(fake, node="hgx-01"), times=3)
    get = reg.get_sample_value
    assert get("traind_gpu_collector_success") == 0
    assert get("traind_gpu_clock_hertz", {"gpu": "1", "clock": "sm"}) is None
    assert get("traind_gpu_clock_max_hertz", {"gpu": "1", "clock": "sm"}) == 1980e6
    assert get("traind_gpu_clock_hertz", {"gpu": "2", "clock": "sm"}) == 1950e6
    assert get("traind_gpu_power_watts", {"gpu": "1"}) == 610
    assert get("traind_gpu_nvlink_active_links", {"gpu": "6", "link": "0"}) is None
    assert get("traind_gpu_nvlink_bytes_total", {"gpu": "6", "link": "0", "direction": "rx"})
    # Exactly what the two failures cost: GPU 1's current clocks, GPU 6's link states.
    lost = {("traind_gpu_clock_hertz", (("clock", c), ("gpu", "1"))) for c in ("memory", "sm")}
    lost |= {("traind_gpu_nvlink_active_links", (("gpu", "6"), ("link", str(i))))
             for i in range(18)}
    assert_series(series(reg), expected_series(node, per_link=True, name="hgx-01") - lost)
    assert exposition_series(text) == len(series(reg))
    # Each distinct failure is logged once, not once per link or per scrape.
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warnings == [
        "GPU collector: GPU 1: nvmlDeviceGetClockInfo: NVMLError_Unknown: Unknown Error",
        "GPU collector: GPU 6: nvmlDeviceGetNvLinkState: RuntimeError: driver hiccup"]


def test_gpm_metrics_appear_on_the_second_scrape(node: dict[str, Any]):
    collector = GpuCollector(FakeNvml(node))
    first = {s.name for fam in collector.collect() for s in fam.samples}
    assert "traind_gpu_power_watts" in first
    assert "traind_gpu_sm_active_ratio" not in first  # one GPM sample: nothing to compare yet
    assert "traind_gpu_pcie_throughput_bytes_per_second" not in first
    reg = CollectorRegistry()
    reg.register(collector)
    get = reg.get_sample_value  # each call is a scrape
    assert get("traind_gpu_sm_active_ratio", {"gpu": "0"}) == pytest.approx(0.88)
    assert get("traind_gpu_sm_active_ratio", {"gpu": "7"}) == pytest.approx(0.95)
    assert get("traind_gpu_pipe_active_ratio", {"gpu": "3", "pipe": "tensor"}) == \
        pytest.approx(0.64)
    assert get("traind_gpu_dram_bandwidth_ratio", {"gpu": "1"}) == pytest.approx(0.53)
    assert get("traind_gpu_pcie_throughput_bytes_per_second",
               {"gpu": "0", "direction": "rx"}) == 2240 * 2**20


def test_close_frees_gpm_samples_and_the_event_set(node: dict[str, Any]):
    fake = FakeNvml(node)
    collector = GpuCollector(fake)
    scrape(collector, times=2)
    assert len(fake.gpm_live) == 16  # two buffers per GPU, reused, never one per scrape
    collector.close()
    assert fake.gpm_live == set() and fake.event_set_freed and fake.shutdowns == 1


def test_promtool_accepts_the_8_gpu_exposition(node: dict[str, Any], tmp_path: Path):
    promtool = "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) \
        else shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true and promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    _, text = scrape(GpuCollector(FakeNvml(node)), times=2)  # second scrape: GPM included
    run = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr


# -- shaping alone, and the fake's fidelity -----------------------------------------------------

def test_shape_is_pure_and_folds_links_into_per_gpu_sums():
    info = DeviceInfo(index=1, uuid="GPU-x", name="NVIDIA H100 80GB HBM3", pci_bus_id="0:1:0.0",
                      links=2, throttle_mask=0, gpm=False)
    sample = GpuSample(info=info, values={("power_watts", ()): 500.0,
                                          ("clock_hertz", ("sm",)): 1.98e9},
                       links=({("nvlink_bytes", ("tx",)): 10.0},
                              {("nvlink_bytes", ("tx",)): 5.0}))
    per_link = {f.name: f for f in shape([sample], per_link=True, node="n")}
    folded = {f.name: f for f in shape([sample], per_link=False, node="n")}
    assert set(per_link) == {"traind_gpu_info", "traind_gpu_power_watts",
                             "traind_gpu_clock_hertz", "traind_gpu_nvlink_bytes"}
    assert [(s.labels, s.value) for s in per_link["traind_gpu_nvlink_bytes"].samples] == [
        ({"gpu": "1", "link": "0", "direction": "tx"}, 10.0),
        ({"gpu": "1", "link": "1", "direction": "tx"}, 5.0)]
    assert [(s.labels, s.value) for s in folded["traind_gpu_nvlink_bytes"].samples] == [
        ({"gpu": "1", "direction": "tx"}, 15.0)]
    assert per_link["traind_gpu_clock_hertz"].samples[0].labels == {"gpu": "1", "clock": "sm"}


def test_catalog_names_follow_prometheus_conventions():
    for key, fam in {**GPU_FAMILIES, **LINK_FAMILIES}.items():
        assert not key.endswith("_total"), key  # counters get _total from the client
        assert "gpu" not in fam.labels and "link" not in fam.labels
        assert fam.help.endswith("."), key


def test_the_fake_speaks_pynvml_names_and_parameters():
    for name, method in inspect.getmembers(FakeNvml, inspect.isfunction):
        if not name.startswith("nvml"):
            continue
        real = getattr(N, name)
        fake_params = list(inspect.signature(method).parameters)[1:]
        assert fake_params == list(inspect.signature(real).parameters), name
