"""Host and process metrics read with psutil at scrape time.

Reading is separate from shaping into families; a failing read sets
``traind_host_collector_success 0`` and never breaks the scrape (node_exporter's rule).
The process families cover the daemon itself and every worker process it launched, labelled
by role, so a worker's CPU and memory are visible without the worker exporting anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class ProcessSample:
    role: str  # daemon | worker
    pid: int
    cpu_seconds: float
    rss_bytes: int
    threads: int
    open_fds: int


def read_processes(roots: Iterable[tuple[str, int]]) -> list[ProcessSample]:
    """Each root pid and its descendants (torchrun's ranks are the launcher's children)."""
    samples = []
    for role, pid in roots:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                with p.oneshot():
                    cpu = p.cpu_times()
                    samples.append(ProcessSample(
                        role=role, pid=p.pid, cpu_seconds=cpu.user + cpu.system,
                        rss_bytes=p.memory_info().rss, threads=p.num_threads(),
                        open_fds=p.num_fds()))
            except psutil.Error:
                continue  # exited between listing and reading
    return samples


class HostCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[int]], daemon_pid: int | None = None):
        self._workers = workers
        self._daemon_pid = daemon_pid or psutil.Process().pid

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        ok = 1.0
        try:
            yield from self._host()
            roots = [("daemon", self._daemon_pid), *(("worker", p) for p in self._workers())]
            yield from self._processes(read_processes(roots))
        except Exception:
            ok = 0.0
        yield GaugeMetricFamily("traind_host_collector_success",
                                "1 if the host collector read everything, else 0.", value=ok)
        yield GaugeMetricFamily("traind_host_collector_duration_seconds",
                                "Time the host collector took.",
                                value=time.perf_counter() - start)

    def _host(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily("traind_host_cpu_seconds", "CPU time by mode, all cores.",
                                  labels=["mode"])
        for mode, seconds in psutil.cpu_times()._asdict().items():
            cpu.add_metric([mode], seconds)
        yield cpu
        yield GaugeMetricFamily("traind_host_cpu_usage_ratio", "CPU busy share since the "
                                "last scrape, all cores (0-1).",
                                value=psutil.cpu_percent(interval=None) / 100.0)
        yield GaugeMetricFamily("traind_host_cpus", "Logical CPUs.", value=psutil.cpu_count())
        mem = psutil.virtual_memory()
        yield GaugeMetricFamily("traind_host_memory_total_bytes", "Physical memory.",
                                value=mem.total)
        yield GaugeMetricFamily("traind_host_memory_available_bytes", "Memory available "
                                "without swapping.", value=mem.available)
        yield GaugeMetricFamily("traind_host_memory_used_bytes", "Memory used.", value=mem.used)
        load = GaugeMetricFamily("traind_host_load", "Load average.", labels=["window"])
        for window, value in zip(("1m", "5m", "15m"), psutil.getloadavg(), strict=True):
            load.add_metric([window], value)
        yield load

    def _processes(self, samples: list[ProcessSample]) -> Iterator[Metric]:
        labels = ["role", "pid"]
        cpu = CounterMetricFamily("traind_process_cpu_seconds", "User and system CPU time.",
                                  labels=labels)
        rss = GaugeMetricFamily("traind_process_resident_memory_bytes", "Resident memory.",
                                labels=labels)
        threads = GaugeMetricFamily("traind_process_threads", "OS threads.", labels=labels)
        fds = GaugeMetricFamily("traind_process_open_fds", "Open file descriptors.",
                                labels=labels)
        for s in samples:
            lab = [s.role, str(s.pid)]
            cpu.add_metric(lab, s.cpu_seconds)
            rss.add_metric(lab, s.rss_bytes)
            threads.add_metric(lab, s.threads)
            fds.add_metric(lab, s.open_fds)
        yield from (cpu, rss, threads, fds)
