from prometheus_client import CollectorRegistry

from traind.metrics.scheduler import SchedulerCollector


def test_states_and_queue_depth():
    reg = CollectorRegistry()
    reg.register(SchedulerCollector(lambda: {"running": 1, "done": 2},
                                    lambda: {"waiting": 3, "running": 2, "done": 5},
                                    lambda: 4))
    get = reg.get_sample_value
    assert get("traind_experiments", {"state": "done"}) == 2
    assert get("traind_experiments", {"state": "failed"}) == 0  # every state, zeros too
    assert get("traind_experiments_trials", {"state": "running"}) == 2
    assert get("traind_experiments_queue_depth") == 3
    assert get("traind_experiments_lease_expiries_total") == 4
    assert get("traind_scheduler_collector_success") == 1


def test_a_failing_database_read_is_reported_not_raised():
    def broken() -> dict[str, int]:
        raise RuntimeError("database is locked")

    reg = CollectorRegistry()
    reg.register(SchedulerCollector(broken, broken))
    assert reg.get_sample_value("traind_scheduler_collector_success") == 0
