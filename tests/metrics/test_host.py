import os

from prometheus_client import CollectorRegistry, generate_latest

from traind.metrics.host import HostCollector, read_processes


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
