"""Host and process metrics read with psutil at scrape time.

Reading is separate from shaping into families; a failing read sets
``traind_host_collector_success 0`` and never breaks the scrape (node_exporter's rule).
The process families cover the daemon itself and every worker process it launched, labelled
by role, so a worker's CPU and memory are visible without the worker exporting anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from prometheus_client.registry import Collector

from traind.metrics.catalog import family

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from prometheus_client.core import Metric


@dataclass(frozen=True, slots=True)
class ProcessSample:
    role: str  # daemon | worker
    pid: int
    cpu_seconds: float
    rss_bytes: int
    threads: int
    open_fds: int


def read_processes(roots: Iterable[tuple[str, int]]) -> list[ProcessSample]:
    """Each root pid, and for workers its descendants (torchrun's ranks are the launcher's
    children; the daemon's children are the launchers, counted as workers)."""
    samples = []
    for role, pid in roots:
        try:
            root = psutil.Process(pid)
            procs = [root, *(root.children(recursive=True) if role == "worker" else ())]
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


# The busy share is measured over at least this long: a scrape that follows another (a page
# polling /metrics beside Prometheus) reads the last window instead of a few milliseconds' one.
USAGE_WINDOW_S = 1.0


def busy_ratio(before: tuple[float, float], after: tuple[float, float]) -> float:
    """CPU busy share between two ``(busy, total)`` CPU-time readings (all cores)."""
    total = after[1] - before[1]
    return min(1.0, max(0.0, (after[0] - before[0]) / total)) if total > 0 else 0.0


def _cpu_reading() -> tuple[float, float]:
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    return total - idle, total


PROC_STAT = Path("/proc/stat")


def parse_procs_running(stat: str) -> int | None:
    """``procs_running`` of ``/proc/stat``: threads running or runnable now (host-wide, also
    inside a container), counting the one that reads it; None if the line is missing."""
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "procs_running":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def read_runnable(stat: Path = PROC_STAT) -> int | None:
    """Runnable threads other than the reader itself (which is running as it reads); None
    where there is no ``/proc/stat`` (not Linux)."""
    try:
        running = parse_procs_running(stat.read_text())
    except OSError:
        return None
    return None if running is None else max(0, running - 1)


def oversubscribed(threads: int, cpus: int) -> bool:
    """More threads wanting to run than CPUs to run them: each waits for its turn, and every
    collective waits for the slowest rank's. The host gauge, a run's summary and the runs
    page's warning all decide with this."""
    return threads > cpus


class HostCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[int]], daemon_pid: int | None = None, *,
                 usable_cpus: Callable[[], int], stat: Path = PROC_STAT):
        """``usable_cpus``: the node's CPU count (``traind.trainer.threads.usable_cpus``,
        handed in by the daemon: metrics never import the trainer); ``stat``: /proc/stat
        (a test's file)."""
        self._workers = workers
        self._usable_cpus, self._stat = usable_cpus, stat
        self._daemon_pid = daemon_pid or psutil.Process().pid
        # Its own baseline: psutil.cpu_percent's is process-wide, shared with any other caller.
        self._usage_at = (time.monotonic(), _cpu_reading())
        self._usage = 0.0

    def _usage_ratio(self) -> float:
        now, reading = time.monotonic(), _cpu_reading()
        if now - self._usage_at[0] >= USAGE_WINDOW_S:
            self._usage = busy_ratio(self._usage_at[1], reading)
            self._usage_at = (now, reading)
        return self._usage

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        ok = 1.0
        try:
            yield from self._host()
            roots = [("daemon", self._daemon_pid), *(("worker", p) for p in self._workers())]
            yield from self._processes(read_processes(roots))
        except Exception:
            ok = 0.0
        yield family("traind_host_collector_success", ok)
        yield family("traind_host_collector_duration_seconds", time.perf_counter() - start)

    def _host(self) -> Iterator[Metric]:
        cpu = family("traind_host_cpu_seconds")
        for mode, seconds in psutil.cpu_times()._asdict().items():
            cpu.add_metric([mode], seconds)
        core = family("traind_host_cpu_core_seconds")
        for i, times in enumerate(psutil.cpu_times(percpu=True)):
            for mode, seconds in times._asdict().items():
                core.add_metric([str(i), mode], seconds)
        yield cpu
        yield core
        yield family("traind_host_cpu_usage_ratio", self._usage_ratio())
        yield family("traind_host_cpus", psutil.cpu_count() or 0)
        cpus = self._usable_cpus()
        yield family("traind_host_usable_cpus", cpus)
        if (runnable := read_runnable(self._stat)) is not None:  # absent off Linux
            yield family("traind_host_runnable_threads", runnable)
            yield family("traind_host_oversubscribed", float(oversubscribed(runnable, cpus)))
        mem, swap = psutil.virtual_memory(), psutil.swap_memory()
        yield family("traind_host_memory_total_bytes", mem.total)
        yield family("traind_host_memory_available_bytes", mem.available)
        yield family("traind_host_memory_used_bytes", mem.used)
        yield family("traind_host_swap_total_bytes", swap.total)
        yield family("traind_host_swap_used_bytes", swap.used)
        load = family("traind_host_load")
        for window, value in zip(("1m", "5m", "15m"), psutil.getloadavg(), strict=True):
            load.add_metric([window], value)
        yield load
        yield from self._disks()
        yield from self._network()

    def _disks(self) -> Iterator[Metric]:
        names = ("traind_host_disk_read_bytes", "traind_host_disk_written_bytes",
                 "traind_host_disk_reads", "traind_host_disk_writes")
        fams = [family(n) for n in names]
        for dev, io in (psutil.disk_io_counters(perdisk=True) or {}).items():
            if dev.startswith(("loop", "ram")):
                continue  # loop and ram devices are not disks anyone waits on
            for fam, value in zip(fams, (io.read_bytes, io.write_bytes, io.read_count,
                                         io.write_count), strict=True):
                fam.add_metric([dev], value)
        yield from fams

    def _network(self) -> Iterator[Metric]:
        rx, tx = family("traind_host_network_received_bytes"), family(
            "traind_host_network_sent_bytes")
        errors = family("traind_host_network_errors")
        for nic, io in (psutil.net_io_counters(pernic=True) or {}).items():
            rx.add_metric([nic], io.bytes_recv)
            tx.add_metric([nic], io.bytes_sent)
            errors.add_metric([nic, "receive"], io.errin)
            errors.add_metric([nic, "transmit"], io.errout)
        yield from (rx, tx, errors)

    def _processes(self, samples: list[ProcessSample]) -> Iterator[Metric]:
        cpu = family("traind_process_cpu_seconds")
        rss = family("traind_process_resident_memory_bytes")
        threads = family("traind_process_threads")
        fds = family("traind_process_open_fds")
        for s in samples:
            lab = [s.role, str(s.pid)]
            cpu.add_metric(lab, s.cpu_seconds)
            rss.add_metric(lab, s.rss_bytes)
            threads.add_metric(lab, s.threads)
            fds.add_metric(lab, s.open_fds)
        yield from (cpu, rss, threads, fds)
