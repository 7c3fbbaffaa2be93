from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from traind.metrics.host import (
    USAGE_WINDOW_S,
    HostCollector,
    busy_ratio,
    oversubscribed,
    parse_procs_running,
    read_processes,
    read_runnable,
)

if TYPE_CHECKING:
    from pathlib import Path


def test_host_and_process_families_with_success():
    reg = CollectorRegistry()
    reg.register(HostCollector(lambda: [os.getpid()], usable_cpus=lambda: 2))
    get = reg.get_sample_value
    assert get("traind_host_collector_success") == 1.0
    assert get("traind_host_memory_total_bytes") > 0
    assert get("traind_host_cpu_seconds_total", {"mode": "user"}) > 0
    pid = str(os.getpid())
    assert get("traind_process_resident_memory_bytes", {"role": "daemon", "pid": pid}) > 0
    assert get("traind_process_resident_memory_bytes", {"role": "worker", "pid": pid}) > 0


def test_a_vanished_process_is_skipped_not_an_error():
    assert read_processes([("worker", 2**22 + 12345)]) == []


def test_a_failing_source_reports_zero_and_the_scrape_survives():
    def broken() -> list[int]:
        raise RuntimeError("boom")

    reg = CollectorRegistry()
    reg.register(HostCollector(broken, usable_cpus=lambda: 2))
    text = generate_latest(reg).decode()
    assert "traind_host_collector_success 0.0" in text


def test_busy_ratio_from_two_readings():
    assert busy_ratio((10.0, 100.0), (13.0, 104.0)) == 0.75
    assert busy_ratio((10.0, 100.0), (10.0, 100.0)) == 0.0  # no time passed: not a division
    assert busy_ratio((10.0, 100.0), (20.0, 101.0)) == 1.0  # clamped (counters read apart)


def test_usage_window_is_the_collectors_own_and_at_least_a_second_long():
    collector = HostCollector(lambda: [], usable_cpus=lambda: 2)
    reg = CollectorRegistry()
    reg.register(collector)
    end = time.monotonic() + USAGE_WINDOW_S + 0.1
    while time.monotonic() < end:  # keep a core busy through one window
        sum(range(1000))
    first = reg.get_sample_value("traind_host_cpu_usage_ratio")
    assert first > 0
    # A second reader right after (a page polling beside Prometheus) sees the same window,
    # not the few milliseconds since the first read.
    assert reg.get_sample_value("traind_host_cpu_usage_ratio") == first


STAT = "cpu  1 2 3 4\nctxt 99\nprocs_running {}\nprocs_blocked 0\n"


@pytest.mark.parametrize(("text", "running"), [
    (STAT.format(5), 5), ("procs_running 1", 1), ("cpu 1 2\n", None), ("procs_running x", None),
])
def test_procs_running(text: str, running: int | None) -> None:
    assert parse_procs_running(text) == running


def test_runnable_leaves_out_the_reader(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(STAT.format(3))
    assert read_runnable(tmp_path / "stat") == 2
    assert read_runnable(tmp_path / "missing") is None  # not Linux: no figure, no error
    assert read_runnable() is not None  # this machine's own /proc/stat


@pytest.mark.parametrize(("threads", "cpus", "over"), [(3, 2, True), (2, 2, False), (0, 1, False)])
def test_oversubscribed(threads: int, cpus: int, over: bool) -> None:
    assert oversubscribed(threads, cpus) is over


@pytest.mark.parametrize(("running", "over"), [(6, 1.0), (3, 0.0)])
def test_runnable_threads_against_usable_cpus(tmp_path: Path, running: int, over: float) -> None:
    (tmp_path / "stat").write_text(STAT.format(running))
    reg = CollectorRegistry()
    reg.register(HostCollector(lambda: [], usable_cpus=lambda: 2, stat=tmp_path / "stat"))
    get = reg.get_sample_value
    assert get("traind_host_usable_cpus") == 2
    assert get("traind_host_runnable_threads") == running - 1
    assert get("traind_host_oversubscribed") == over
    assert get("traind_host_collector_success") == 1.0


def test_no_proc_stat_leaves_the_runnable_families_out_not_the_scrape(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    reg.register(HostCollector(lambda: [], usable_cpus=lambda: 2, stat=tmp_path / "missing"))
    assert reg.get_sample_value("traind_host_oversubscribed") is None
    assert reg.get_sample_value("traind_host_collector_success") == 1.0
