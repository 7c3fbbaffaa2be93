import os
import time

from prometheus_client import CollectorRegistry, generate_latest

from traind.metrics.host import USAGE_WINDOW_S, HostCollector, busy_ratio, read_processes


def test_host_and_process_families_with_success():
    reg = CollectorRegistry()
    reg.register(HostCollector(lambda: [os.getpid()]))
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
    reg.register(HostCollector(broken))
    text = generate_latest(reg).decode()
    assert "traind_host_collector_success 0.0" in text


def test_busy_ratio_from_two_readings():
    assert busy_ratio((10.0, 100.0), (13.0, 104.0)) == 0.75
    assert busy_ratio((10.0, 100.0), (10.0, 100.0)) == 0.0  # no time passed: not a division
    assert busy_ratio((10.0, 100.0), (20.0, 101.0)) == 1.0  # clamped (counters read apart)


def test_usage_window_is_the_collectors_own_and_at_least_a_second_long():
    collector = HostCollector(lambda: [])
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
