"""The GPU collector: NVIDIA GPUs, PCIe and NVLink through NVML, read at scrape time.

Reading lives in ``gpu_read`` and shaping in ``gpu_shape``; this module owns what lasts
between scrapes: the NVML session, device handles, GPM sample pairs and the XID event set.

A host without NVIDIA (no libnvidia-ml, no driver, no GPUs) is normal, not an error: the
collector logs "no NVIDIA device: <reason>" once, exports ``traind_gpu_devices 0`` with
``traind_gpu_collector_success 1``, and tries ``nvmlInit`` again at most every ``retry_s``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pynvml
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from traind.metrics.gpu_read import (
    DeviceInfo,
    GpmPair,
    NvmlApi,
    Probe,
    XidWatch,
    read_device_info,
    read_gpu,
)
from traind.metrics.gpu_shape import shape

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


@dataclass
class _Session:
    """An open NVML session: each GPU's handle and identity, plus the stateful readers."""

    devices: list[tuple[DeviceInfo, object]]
    gpm: dict[int, GpmPair]
    xid: XidWatch | None


class GpuCollector(Collector):
    """Per-GPU, per-PCIe-link and per-NVLink families for a registry the caller owns.

    ``nvml`` is the ``pynvml`` module (default) or an object with the same function names.
    ``per_link=False`` folds the NVLink families into per-GPU sums (18 links per H100).
    ``node`` goes on ``traind_gpu_info`` only; Prometheus' ``instance`` names the target.
    """

    def __init__(self, nvml: NvmlApi | None = None, *, per_link: bool = True,
                 node: str | None = None, retry_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Importing pynvml loads no library; nvmlInit does, at the first scrape.
        self._api = pynvml if nvml is None else nvml
        self._per_link = per_link
        self._node = node or socket.gethostname()
        self._retry_s = retry_s
        self._clock = clock
        self._session: _Session | None = None
        self._next_open: float | None = None
        self._said_no_device = False
        # Why NVML sees no GPU (its error, or "NVML reports 0 GPUs"); None while it sees one
        # or before the first try. For the Hardware page to say.
        self.absent_reason: str | None = None
        self._last_open: bool | None = None
        self._logged_errors: set[str] = set()
        # Scrapes may overlap (threaded HTTP server); the GPM pairs and the event set may not.
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        with self._lock:
            families, ok, devices, unsupported = self._scrape()
        yield from families
        yield GaugeMetricFamily("traind_gpu_devices", "NVIDIA GPUs NVML reports (0 on a host "
                                "without them).", value=devices)
        if devices:
            yield GaugeMetricFamily("traind_gpu_collector_unsupported_fields", "GPU queries "
                                    "this driver or GPU does not support, skipped in the last "
                                    "scrape.", value=unsupported)
        yield GaugeMetricFamily("traind_gpu_collector_success",
                                "1 if the GPU collector read everything it could, else 0.",
                                value=1.0 if ok else 0.0)
        yield GaugeMetricFamily("traind_gpu_collector_duration_seconds",
                                "Time the GPU collector took.",
                                value=time.perf_counter() - start)

    def close(self) -> None:
        """Free GPM samples and the event set, and shut NVML down (the daemon's exit)."""
        with self._lock:
            self._close_session()

    def _scrape(self) -> tuple[list[Metric], bool, int, int]:
        if self._session is None:
            opened = self._open()
            if opened is not True:
                return [], opened is None, 0, 0
        assert self._session is not None
        probe = Probe()
        try:
            families = self._read(self._session, probe)
        except Exception as e:  # a bug in shaping, say: still no broken scrape
            probe.where = ""
            probe.error(f"{type(e).__name__}: {e}")
            families = []
        for error in probe.errors:
            if error not in self._logged_errors and len(self._logged_errors) < 256:
                self._logged_errors.add(error)  # once each, not once per scrape
                log.warning("GPU collector: %s", error)
        return families, not probe.errors, len(self._session.devices), probe.unsupported

    def _read(self, session: _Session, probe: Probe) -> list[Metric]:
        if session.xid is not None:
            session.xid.drain(probe)
        samples = []
        for info, handle in session.devices:
            probe.where = f"GPU {info.index}"
            extra = session.gpm[info.index].read(handle, probe) if info.index in session.gpm \
                else {}
            if session.xid is not None:
                extra.update(session.xid.values(info.index))
            samples.append(read_gpu(self._api, handle, info, probe, extra))
        return shape(samples, per_link=self._per_link, node=self._node)

    def _open(self) -> bool | None:
        """True: open. None: no device (fine). False: NVML is there but failed (an error)."""
        now = self._clock()
        if self._next_open is not None and now < self._next_open:
            return self._last_open  # between tries, report what the last try found
        self._next_open = now + self._retry_s
        self._last_open = self._try_open()
        return self._last_open

    def _try_open(self) -> bool | None:
        try:
            self._api.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._no_device(str(e) or type(e).__name__)
            return None
        try:
            count = self._api.nvmlDeviceGetCount()
            if count == 0:
                self._api.nvmlShutdown()
                self._no_device("NVML reports 0 GPUs")
                return None
            self._session = self._discover(count)
            self._said_no_device = False
            self.absent_reason = None
            return True
        except Exception as e:
            log.warning("NVML opened but listing the GPUs failed (next try in %.0f s): %s",
                         self._retry_s, e)
            self._shutdown()
            return False

    def _discover(self, count: int) -> _Session:
        handles = {i: self._api.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
        probe = Probe()
        devices, gpm = [], {}
        for i, handle in handles.items():
            probe.where = f"GPU {i}"
            info = read_device_info(self._api, i, handle, probe)
            if info.gpm:
                try:
                    gpm[i] = GpmPair(self._api)
                except Exception as e:  # no GPM after all: PCIe throughput from the 20 ms probe
                    log.info("GPU %d: GPM unavailable: %s", i, e)
                    info = replace(info, gpm=False)
            devices.append((info, handle))
        try:
            xid: XidWatch | None = XidWatch(self._api, handles)
        except Exception as e:
            log.info("no XID events: %s", e)
            xid = None
        session = _Session(devices=devices, gpm=gpm, xid=xid)
        if probe.errors:
            _free(session)
            raise RuntimeError("; ".join(probe.errors))
        log.info("NVML: %d GPU(s): %s", count, ", ".join(sorted({d.name for d, _ in devices})))
        return session

    def _no_device(self, reason: str) -> None:
        self.absent_reason = reason
        if not self._said_no_device:
            log.info("no NVIDIA device: %s", reason)
            self._said_no_device = True

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            _free(session)
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._api.nvmlShutdown()
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)


def _free(session: _Session) -> None:
    for pair in session.gpm.values():
        pair.close()
    if session.xid is not None:
        session.xid.close()
