"""Reading NVIDIA GPUs through NVML into plain, frozen samples (no Prometheus here).

Every NVML query goes through a :class:`Probe`: "not supported" on one GPU skips that one
series and is counted; any other failure is recorded (the collector then reports success 0)
and the rest of the read carries on, so one bad query never costs the other families.

Values are converted to base units here (bytes, seconds, joules, watts, hertz, ratios 0-1),
so the shaping in ``gpu_shape`` is pure bookkeeping. A sample is a map from
``(family key, label values)`` to a number; the keys are the catalog's in ``gpu_shape``.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pynvml as N  # constants and exception classes only; calls go through the injected api

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

# The real ``pynvml`` module or a stand-in with the same function names (tests serve a fake
# node). Typed loosely on purpose: a Protocol would repeat ~30 signatures pynvml leaves untyped.
NvmlApi = Any
Key = tuple[str, tuple[str, ...]]  # (family key, label values after gpu[/link])

# Missing on this GPU or this driver: skip the series, count it, carry on.
_UNSUPPORTED = (N.NVMLError_NotSupported, N.NVMLError_FunctionNotFound)

THROTTLE_REASONS = {  # nvmlClocksEventReason* bit -> label
    "gpu_idle": N.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": N.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": N.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": N.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": N.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": N.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": N.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": N.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": N.nvmlClocksEventReasonDisplayClockSetting,
}
THROTTLE_POLICIES = {  # violation-time counters, NVML_PERF_POLICY_* -> label
    "power": N.NVML_PERF_POLICY_POWER,
    "thermal": N.NVML_PERF_POLICY_THERMAL,
    "sync_boost": N.NVML_PERF_POLICY_SYNC_BOOST,
    "board_limit": N.NVML_PERF_POLICY_BOARD_LIMIT,
    "low_utilization": N.NVML_PERF_POLICY_LOW_UTILIZATION,
    "reliability": N.NVML_PERF_POLICY_RELIABILITY,
    "total_app_clocks": N.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
    "total_base_clocks": N.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
}
NVLINK_ERRORS = {
    "crc_flit": N.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    "crc_data": N.NVML_NVLINK_ERROR_DL_CRC_DATA,
    "replay": N.NVML_NVLINK_ERROR_DL_REPLAY,
    "recovery": N.NVML_NVLINK_ERROR_DL_RECOVERY,
}
# Device-scoped field values, read in one nvmlDeviceGetFieldValues call per GPU.
# field id -> (family key, label values, scale to base units)
DEVICE_FIELDS: dict[int, tuple[str, tuple[str, ...], float]] = {
    N.NVML_FI_DEV_MEMORY_TEMP: ("temperature_celsius", ("memory",), 1.0),
    N.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: ("pcie_bytes", ("tx",), 1.0),
    N.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: ("pcie_bytes", ("rx",), 1.0),
    N.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: ("ecc_errors", ("corrected", "volatile"), 1.0),
    N.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: ("ecc_errors", ("uncorrected", "volatile"), 1.0),
    N.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: ("ecc_errors", ("corrected", "aggregate"), 1.0),
    N.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: ("ecc_errors", ("uncorrected", "aggregate"), 1.0),
    N.NVML_FI_DEV_REMAPPED_COR: ("remapped_rows", ("correctable",), 1.0),
    N.NVML_FI_DEV_REMAPPED_UNC: ("remapped_rows", ("uncorrectable",), 1.0),
    N.NVML_FI_DEV_REMAPPED_PENDING: ("row_remap_pending", (), 1.0),
    N.NVML_FI_DEV_REMAPPED_FAILURE: ("row_remap_failed", (), 1.0),
}
# Link-scoped field values (scopeId = link): cumulative NVLink data bytes, reported in KiB.
LINK_FIELDS: dict[int, tuple[str, tuple[str, ...], float]] = {
    N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: ("nvlink_bytes", ("tx",), 1024.0),
    N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: ("nvlink_bytes", ("rx",), 1024.0),
}
# GPM (Hopper+): metric id -> (family key, label values, scale). Utilisations come in percent.
GPM_METRICS: dict[int, tuple[str, tuple[str, ...], float]] = {
    N.NVML_GPM_METRIC_GRAPHICS_UTIL: ("graphics_active_ratio", (), 0.01),
    N.NVML_GPM_METRIC_SM_UTIL: ("sm_active_ratio", (), 0.01),
    N.NVML_GPM_METRIC_SM_OCCUPANCY: ("sm_occupancy_ratio", (), 0.01),
    N.NVML_GPM_METRIC_DRAM_BW_UTIL: ("dram_bandwidth_ratio", (), 0.01),
    N.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("pipe_active_ratio", ("tensor",), 0.01),
    N.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: ("pipe_active_ratio", ("tensor_hmma",), 0.01),
    N.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: ("pipe_active_ratio", ("tensor_imma",), 0.01),
    N.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: ("pipe_active_ratio", ("tensor_dfma",), 0.01),
    N.NVML_GPM_METRIC_FP64_UTIL: ("pipe_active_ratio", ("fp64",), 0.01),
    N.NVML_GPM_METRIC_FP32_UTIL: ("pipe_active_ratio", ("fp32",), 0.01),
    N.NVML_GPM_METRIC_FP16_UTIL: ("pipe_active_ratio", ("fp16",), 0.01),
    N.NVML_GPM_METRIC_INTEGER_UTIL: ("pipe_active_ratio", ("integer",), 0.01),
    # Averaged over the whole scrape interval, and free once GPM runs; see read_gpu.
    N.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie_throughput_bytes_per_second", ("tx",), 2.0**20),
    N.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie_throughput_bytes_per_second", ("rx",), 2.0**20),
}
_VALUE_MEMBER = {  # c_nvmlFieldValue_t.valueType -> the c_nvmlValue_t union member to read
    N.NVML_VALUE_TYPE_DOUBLE: "dVal",
    N.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    N.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    N.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    N.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    N.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


@dataclass
class Probe:
    """Runs NVML queries for one scrape and keeps score of what did not answer."""

    unsupported: int = 0
    errors: list[str] = field(default_factory=list)
    where: str = ""  # "GPU 3" while reading GPU 3, so a logged error says which

    def error(self, what: str) -> None:
        self.errors.append(f"{self.where}: {what}" if self.where else what)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _UNSUPPORTED:
            self.unsupported += 1
        except Exception as e:  # a lost GPU, a permission, a driver bug: report, keep reading
            self.error(f"{getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}")
        return None

    def fields(self, api: NvmlApi, handle: object,
               ids: Iterable[int | tuple[int, int]]) -> dict[tuple[int, int], float]:
        """One nvmlDeviceGetFieldValues call; each field answers (or fails) on its own."""
        out: dict[tuple[int, int], float] = {}
        ids = list(ids)
        if not ids:
            return out
        values = self(api.nvmlDeviceGetFieldValues, handle, ids)
        for fv in values if values is not None else ():
            if fv.nvmlReturn == N.NVML_SUCCESS:
                out[(fv.fieldId, fv.scopeId)] = field_number(fv)
            elif fv.nvmlReturn == N.NVML_ERROR_NOT_SUPPORTED:
                self.unsupported += 1
            else:
                self.error(f"field {fv.fieldId}/{fv.scopeId}: NVML return {fv.nvmlReturn}")
        return out


def field_number(fv: Any) -> float:
    """The number in a ``c_nvmlFieldValue_t``, read through the union member its type names."""
    return float(getattr(fv.value, _VALUE_MEMBER[fv.valueType]))


def handle_key(handle: object) -> int:
    """A stable key for a device handle: the pointer's address (ctypes pointers compare by
    identity, and an event's ``device`` is a fresh pointer object to the same device)."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    return id(handle)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What does not change while the driver is loaded; read once when NVML opens."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    links: int  # NVLinks on this GPU (0 for a PCIe-only card)
    throttle_mask: int  # supported clock-event reasons
    gpm: bool  # GPU Performance Monitoring (Hopper and later)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one scrape, in base units. ``links[i]`` holds link i's series."""

    info: DeviceInfo
    values: Mapping[Key, float]
    links: tuple[Mapping[Key, float], ...] = ()


def read_device_info(api: NvmlApi, index: int, handle: object, probe: Probe) -> DeviceInfo:
    """Identity and capabilities. Identity failing is an error, not a skip: without a uuid
    the info series would lie."""
    uuid, name = api.nvmlDeviceGetUUID(handle), api.nvmlDeviceGetName(handle)
    bus = api.nvmlDeviceGetPciInfo(handle).busId
    count = probe.fields(api, handle, [N.NVML_FI_DEV_NVLINK_LINK_COUNT])
    mask = probe(api.nvmlDeviceGetSupportedClocksEventReasons, handle)
    gpm = probe(api.nvmlGpmQueryDeviceSupport, handle)
    return DeviceInfo(
        index=index, uuid=_text(uuid), name=_text(name), pci_bus_id=_text(bus),
        links=int(count.get((N.NVML_FI_DEV_NVLINK_LINK_COUNT, 0), 0)),
        throttle_mask=N.nvmlClocksEventReasonAll if mask is None else int(mask),
        gpm=bool(gpm is not None and gpm.isSupportedDevice))


def read_gpu(api: NvmlApi, handle: object, info: DeviceInfo, probe: Probe,
             extra: Mapping[Key, float] | None = None) -> GpuSample:
    """Every per-GPU series NVML answers, plus ``extra``: what the collector keeps across
    scrapes for this GPU (GPM figures for the interval, XID counts)."""
    v: dict[Key, float] = {}

    def put(key: str, labels: tuple[str, ...], raw: float | None, scale: float = 1.0) -> None:
        if raw is not None:
            v[(key, labels)] = float(raw) * scale

    util = probe(api.nvmlDeviceGetUtilizationRates, handle)
    if util is not None:
        put("utilization_ratio", (), util.gpu, 0.01)
        put("memory_utilization_ratio", (), util.memory, 0.01)
    # v2 adds the driver's reserved memory; a driver without it still answers v1.
    mem = probe(api.nvmlDeviceGetMemoryInfo, handle, version=N.nvmlMemory_v2)
    if mem is None:
        mem = probe(api.nvmlDeviceGetMemoryInfo, handle)
    if mem is not None:
        for part in ("used", "free", "total", "reserved"):
            put(f"memory_{part}_bytes", (), getattr(mem, part, None))
    put("power_watts", (), probe(api.nvmlDeviceGetPowerUsage, handle), 1e-3)  # mW
    put("power_limit_watts", (), probe(api.nvmlDeviceGetEnforcedPowerLimit, handle), 1e-3)
    put("energy_joules", (), probe(api.nvmlDeviceGetTotalEnergyConsumption, handle), 1e-3)
    put("temperature_celsius", ("gpu",),
        probe(api.nvmlDeviceGetTemperatureV, handle, N.NVML_TEMPERATURE_GPU))
    for label, clock in (("sm", N.NVML_CLOCK_SM), ("memory", N.NVML_CLOCK_MEM)):
        put("clock_hertz", (label,), probe(api.nvmlDeviceGetClockInfo, handle, clock), 1e6)
        put("clock_max_hertz", (label,),
            probe(api.nvmlDeviceGetMaxClockInfo, handle, clock), 1e6)
    reasons = probe(api.nvmlDeviceGetCurrentClocksEventReasons, handle)
    if reasons is not None:
        for label, bit in THROTTLE_REASONS.items():
            if info.throttle_mask & bit:
                put("throttle_reason", (label,), 1.0 if reasons & bit else 0.0)
    for label, policy in THROTTLE_POLICIES.items():
        # Deprecated for field values in CUDA 14, but the only form whose unit (ns) NVML
        # documents; swap when the field ids' units are.
        viol = probe(api.nvmlDeviceGetViolationStatus, handle, policy)
        if viol is not None:
            put("throttle_seconds", (label,), viol.violationTime, 1e-9)
    if not info.gpm:
        # Each call samples for ~20 ms, so on GPM devices the interval average replaces it.
        for label, counter in (("tx", N.NVML_PCIE_UTIL_TX_BYTES),
                               ("rx", N.NVML_PCIE_UTIL_RX_BYTES)):
            put("pcie_throughput_bytes_per_second", (label,),
                probe(api.nvmlDeviceGetPcieThroughput, handle, counter), 1024.0)  # KB/s
    put("pcie_link_generation", (), probe(api.nvmlDeviceGetCurrPcieLinkGeneration, handle))
    put("pcie_link_max_generation", (), probe(api.nvmlDeviceGetMaxPcieLinkGeneration, handle))
    put("pcie_link_width", (), probe(api.nvmlDeviceGetCurrPcieLinkWidth, handle))
    put("pcie_link_max_width", (), probe(api.nvmlDeviceGetMaxPcieLinkWidth, handle))
    put("pcie_replays", (), probe(api.nvmlDeviceGetPcieReplayCounter, handle))
    for (fid, _), value in probe.fields(api, handle, DEVICE_FIELDS).items():
        key, labels, scale = DEVICE_FIELDS[fid]
        put(key, labels, value, scale)
    v.update(extra or {})
    return GpuSample(info=info, values=v, links=read_links(api, handle, info.links, probe))


def read_links(api: NvmlApi, handle: object, count: int,
               probe: Probe) -> tuple[Mapping[Key, float], ...]:
    links: list[dict[Key, float]] = [{} for _ in range(count)]
    wanted = [(fid, link) for link in range(count) for fid in LINK_FIELDS]
    for (fid, link), value in probe.fields(api, handle, wanted).items():
        key, labels, scale = LINK_FIELDS[fid]
        links[link][(key, labels)] = value * scale
    for link, out in enumerate(links):
        state = probe(api.nvmlDeviceGetNvLinkState, handle, link)
        if state is not None:
            out[("nvlink_active_links", ())] = 1.0 if state == N.NVML_FEATURE_ENABLED else 0.0
        for label, counter in NVLINK_ERRORS.items():
            n = probe(api.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
            if n is not None:
                out[("nvlink_errors", (label,))] = float(n)
    return tuple(links)


class GpmPair:
    """Two GPM sample buffers per GPU, reused: each scrape fills one and compares it with the
    other, so the figures cover exactly the time between successive scrapes."""

    def __init__(self, api: NvmlApi) -> None:
        self._api = api
        self._bufs = (api.nvmlGpmSampleAlloc(), api.nvmlGpmSampleAlloc())
        self._latest: int | None = None  # which buffer holds the previous scrape's sample

    def read(self, handle: object, probe: Probe) -> dict[Key, float]:
        nxt = 0 if self._latest is None else 1 - self._latest
        if probe(self._api.nvmlGpmSampleGet, handle, self._bufs[nxt]) is None:
            self._latest = None  # a gap: start over rather than compare across it
            return {}
        prev, self._latest = self._latest, nxt
        if prev is None:
            return {}  # the first scrape only primes the pair
        req = N.c_nvmlGpmMetricsGet_t()
        req.version = N.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(GPM_METRICS)
        req.sample1, req.sample2 = self._bufs[prev], self._bufs[nxt]
        for i, metric in enumerate(GPM_METRICS):
            req.metrics[i].metricId = metric
        if probe(self._api.nvmlGpmMetricsGet, req) is None:
            return {}
        out: dict[Key, float] = {}
        for i in range(req.numMetrics):
            m = req.metrics[i]
            if m.nvmlReturn == N.NVML_SUCCESS:
                key, labels, scale = GPM_METRICS[m.metricId]
                out[(key, labels)] = m.value * scale
            else:
                probe.unsupported += 1
        return out

    def close(self) -> None:
        for buf in self._bufs:
            try:
                self._api.nvmlGpmSampleFree(buf)
            except Exception:  # shutting down: nothing left to report to
                log.debug("freeing a GPM sample failed", exc_info=True)


class XidWatch:
    """XID (critical error) events through an NVML event set, drained without waiting at
    each scrape; counts and the latest code per GPU live here for the life of the collector."""

    MAX_DRAIN = 1024  # per scrape: a storm must not stall the scrape

    def __init__(self, api: NvmlApi, handles: Mapping[int, object]) -> None:
        self._api = api
        self._index: dict[int, int] = {}
        self.counts: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self._set = api.nvmlEventSetCreate()
        for index, handle in handles.items():
            try:
                api.nvmlDeviceRegisterEvents(handle, N.nvmlEventTypeXidCriticalError, self._set)
            except Exception as e:  # MIG, vGPU or permissions: that GPU has no XID series
                log.info("GPU %d: no XID events: %s", index, e)
                continue
            self._index[handle_key(handle)] = index
            self.counts[index], self.last[index] = 0, 0

    def drain(self, probe: Probe) -> None:
        for _ in range(self.MAX_DRAIN):
            try:
                event = self._api.nvmlEventSetWait(self._set, 0)
            except N.NVMLError_Timeout:
                return  # queue empty
            except Exception as e:
                probe.error(f"nvmlEventSetWait: {type(e).__name__}: {e}")
                return
            index = self._index.get(handle_key(event.device))
            if index is not None and event.eventType & N.nvmlEventTypeXidCriticalError:
                self.counts[index] += 1
                self.last[index] = int(event.eventData)

    def values(self, index: int) -> dict[Key, float]:
        if index not in self.counts:
            return {}
        return {("xid_errors", ()): float(self.counts[index]),
                ("last_xid", ()): float(self.last[index])}

    def close(self) -> None:
        try:
            self._api.nvmlEventSetFree(self._set)
        except Exception:
            log.debug("freeing the NVML event set failed", exc_info=True)
