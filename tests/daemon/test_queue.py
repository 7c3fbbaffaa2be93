"""Contract tests of the experiment queue, run alike against SQLite and a real PostgreSQL."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, event, inspect

from traind.daemon.db import queue
from traind.daemon.db.engine import make_engine
from traind.daemon.db.migrate import downgrade, upgrade
from traind.daemon.db.models import Base

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
VERSIONS = {"traind_version": "0.test", "torch_version": "2.13.0", "device": "cpu (test)"}


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'queue.db'}"
    return str(request.getfixturevalue("fresh_postgres_url"))


@pytest.fixture
def engine(url: str) -> Iterator[Engine]:
    upgrade(url)
    eng = make_engine(url)
    yield eng
    eng.dispose()


def _experiment(engine: Engine, *, arms: tuple[str, ...] = ("A", "B"), repeats: int = 2,
                name: str = "exp") -> int:
    return queue.create_experiment(
        engine, name=name, mode="forked", base_config={"job": {"steps": 10}},
        arms=[{"name": a, "overrides": {"precision": a.lower()}, "baseline": a == arms[0]}
              for a in arms],
        objective={"quality_margin": 0.02}, budget={"steps": 10, "max_trials": 8},
        repeats=repeats, **VERSIONS)


def _claim(engine: Engine, owner: str = "w1", at: datetime = T0, lease: float = 10.0,
           ) -> queue.ClaimedTrial | None:
    return queue.claim(engine, owner=owner, lease_seconds=lease, now=at)


def _names(engine: Engine, exp: int) -> str:
    return "".join(t.arm_name for t in queue.list_trials(engine, experiment_id=exp))


def test_balanced_order_alternates_direction() -> None:
    assert queue.balanced_order(2, 3) == [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2)]
    assert queue.balanced_order(3, 1) == [(0, 0), (1, 0), (2, 0)]


def test_migration_matches_models_and_downgrades(url: str) -> None:
    upgrade(url)
    eng = make_engine(url)
    try:
        with eng.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations drifted: {diff}"
        assert {"experiments", "arms", "trials"} <= set(inspect(eng).get_table_names())
        downgrade(url, "0001")
        assert not {"experiments", "arms", "trials"} & set(inspect(eng).get_table_names())
        downgrade(url)
        assert set(inspect(eng).get_table_names()) <= {"alembic_version"}
        upgrade(url)
        assert "trials" in inspect(eng).get_table_names()
    finally:
        eng.dispose()


def test_trials_are_created_in_abba_order(engine: Engine) -> None:
    two = _experiment(engine, repeats=3)
    three = _experiment(engine, arms=("A", "B", "C"), repeats=2, name="three")
    assert _names(engine, two) == "ABBAAB"
    assert _names(engine, three) == "ABCCBA"
    # The second experiment queues after the first, not interleaved with it.
    assert [t.experiment_id for t in queue.list_trials(engine)] == [two] * 6 + [three] * 6
    assert queue.queue_depth(engine) == {
        "waiting": 12, "running": 0, "done": 0, "failed": 0, "cancelled": 0}


def test_claim_takes_trials_in_order_with_attempt_one(engine: Engine) -> None:
    exp = _experiment(engine)
    order = [t.id for t in queue.list_trials(engine, experiment_id=exp)]
    claimed = [_claim(engine, owner=f"w{i}") for i in range(4)]
    assert [c.trial_id for c in claimed if c] == order
    first = claimed[0]
    assert first is not None
    assert (first.experiment_id, first.attempt, first.repeat) == (exp, 1, 0)
    assert first.overrides == {"precision": "a"}
    assert first.lease_expires_at == T0 + timedelta(seconds=10)
    assert _claim(engine) is None
    assert queue.queue_depth(engine)["running"] == 4
    assert {t.lease_owner for t in queue.list_trials(engine)} == {"w0", "w1", "w2", "w3"}


def test_concurrent_claimers_never_share_a_trial(engine: Engine) -> None:
    _experiment(engine, repeats=20)  # 40 trials
    taken: list[tuple[str, int, int]] = []
    lock = threading.Lock()
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(owner: str) -> None:
        try:
            start.wait()
            while (c := queue.claim(engine, owner=owner, lease_seconds=60)) is not None:
                with lock:
                    taken.append((owner, c.trial_id, c.attempt))
                assert queue.complete(engine, trial_id=c.trial_id, attempt=c.attempt,
                                      result={"by": owner})
        except BaseException as e:  # surfaced below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    per_trial = Counter(trial_id for _, trial_id, _ in taken)
    assert len(per_trial) == 40 and set(per_trial.values()) == {1}
    assert {attempt for *_, attempt in taken} == {1}
    assert queue.queue_depth(engine)["done"] == 40
    # Each stored result is the one its claimer sent.
    by_owner = {trial_id: owner for owner, trial_id, _ in taken}
    assert all(t.result == {"by": by_owner[t.id]} for t in queue.list_trials(engine))


def test_expired_lease_is_reclaimed_and_stale_result_refused(engine: Engine) -> None:
    _experiment(engine, repeats=1)
    a = _claim(engine, owner="w1", at=T0)
    b = _claim(engine, owner="w2", at=T0 + timedelta(seconds=1))
    assert a and b and _claim(engine, owner="w3", at=T0 + timedelta(seconds=9)) is None
    # At T0+10.5 only a's lease (to T0+10) has run out; b's runs to T0+11.
    again = _claim(engine, owner="w3", at=T0 + timedelta(seconds=10.5))
    assert again is not None
    assert (again.trial_id, again.attempt) == (a.trial_id, 2)
    assert queue.lease_expiries(engine) == 1  # what the scheduler collector exports
    # The first worker was only slow: its heartbeat and its result are now refused.
    assert not queue.heartbeat(engine, trial_id=a.trial_id, attempt=1, owner="w1",
                               lease_seconds=10, now=T0 + timedelta(seconds=11))
    assert not queue.complete(engine, trial_id=a.trial_id, attempt=1, result={"tps": 1.0})
    assert queue.complete(engine, trial_id=a.trial_id, attempt=2, result={"tps": 2.0})
    # Exactly once: a repeat of the accepted call changes nothing.
    assert not queue.complete(engine, trial_id=a.trial_id, attempt=2, result={"tps": 3.0})
    assert not queue.fail(engine, trial_id=a.trial_id, attempt=2, error="late")
    (done,) = [t for t in queue.list_trials(engine) if t.id == a.trial_id]
    assert (done.state, done.attempt, done.result, done.error) == ("done", 2, {"tps": 2.0}, None)


def test_a_trial_that_keeps_losing_its_worker_fails(engine: Engine) -> None:
    _experiment(engine, repeats=1)
    first = _claim(engine, at=T0, lease=1)
    assert first is not None
    for attempt in (2, 3):
        c = queue.claim(engine, owner="w", lease_seconds=1, max_attempts=3,
                        experiment_id=first.experiment_id, now=T0 + timedelta(seconds=2 * attempt))
        assert c and (c.trial_id, c.attempt) == (first.trial_id, attempt)
    # The other trial is still waiting: it is claimed, and the lost one is failed.
    last = _claim(engine, at=T0 + timedelta(seconds=10))
    assert last is not None and last.trial_id != first.trial_id
    (lost,) = [t for t in queue.list_trials(engine) if t.id == first.trial_id]
    assert (lost.state, lost.attempt) == ("failed", 3) and "3 attempts" in (lost.error or "")


def test_heartbeat_extends_only_the_current_owners_lease(engine: Engine) -> None:
    _experiment(engine, repeats=1)
    a = _claim(engine, owner="w1", at=T0)
    b = _claim(engine, owner="w2", at=T0)
    assert a and b
    beat = {"trial_id": a.trial_id, "lease_seconds": 10, "now": T0 + timedelta(seconds=8)}
    assert not queue.heartbeat(engine, attempt=1, owner="w2", **beat)
    assert not queue.heartbeat(engine, attempt=2, owner="w1", **beat)
    assert queue.heartbeat(engine, attempt=1, owner="w1", **beat)
    # At T0+12 b's lease has run out but a's was extended to T0+18.
    c = _claim(engine, owner="w3", at=T0 + timedelta(seconds=12))
    assert c and (c.trial_id, c.attempt) == (b.trial_id, 2)
    assert _claim(engine, owner="w3", at=T0 + timedelta(seconds=17)) is None
    assert not queue.heartbeat(engine, trial_id=b.trial_id, attempt=1, owner="w2",
                               lease_seconds=10, now=T0 + timedelta(seconds=13))


def test_fail_records_the_error_for_the_current_attempt(engine: Engine) -> None:
    _experiment(engine, repeats=1)
    a = _claim(engine)
    assert a is not None
    assert queue.fail(engine, trial_id=a.trial_id, attempt=1, error="CUDA OOM")
    assert not queue.complete(engine, trial_id=a.trial_id, attempt=1, result={})
    assert queue.queue_depth(engine)["failed"] == 1


def test_reorder_changes_claim_order(engine: Engine) -> None:
    first = _experiment(engine)
    second = _experiment(engine, name="second")
    t = [x.id for x in queue.list_trials(engine, experiment_id=first)]
    later = [x.id for x in queue.list_trials(engine, experiment_id=second)]
    queue.reorder(engine, trial_ids_in_order=[t[3], t[1]])  # swap two slots
    claimed = [c.trial_id for c in iter(lambda: _claim(engine), None)]
    assert claimed == [t[0], t[3], t[2], t[1], *later]


def test_reorder_refuses_unknown_or_running_trials(engine: Engine) -> None:
    _experiment(engine)
    a = _claim(engine)
    assert a is not None
    before = queue.list_trials(engine)
    waiting = [x.id for x in before if x.state == "waiting"]
    with pytest.raises(ValueError, match="not waiting"):
        queue.reorder(engine, trial_ids_in_order=[*reversed(waiting), a.trial_id])
    with pytest.raises(ValueError, match="not waiting"):
        queue.reorder(engine, trial_ids_in_order=[999_999])
    assert queue.list_trials(engine) == before  # nothing half-done


def test_cancel_stops_claims_and_refuses_results(engine: Engine) -> None:
    doomed = _experiment(engine)
    kept = _experiment(engine, name="kept")
    running = _claim(engine)
    assert running is not None and running.experiment_id == doomed
    assert queue.cancel_experiment(engine, experiment_id=doomed) == 4
    assert not queue.heartbeat(engine, trial_id=running.trial_id, attempt=1, owner="w1",
                               lease_seconds=10, now=T0)
    assert not queue.complete(engine, trial_id=running.trial_id, attempt=1, result={})
    claimed = [c.experiment_id for c in iter(lambda: _claim(engine), None)]
    assert claimed == [kept] * 4
    assert queue.queue_depth(engine) == {
        "waiting": 0, "running": 4, "done": 0, "failed": 0, "cancelled": 4}
    assert queue.cancel_experiment(engine, experiment_id=doomed) == 0


def _state(engine: Engine, exp: int) -> str:
    view = queue.get_experiment(engine, experiment_id=exp)
    assert view is not None
    return view.state


def test_experiment_state_follows_claims_and_verdict(engine: Engine) -> None:
    exp = _experiment(engine, repeats=1)
    view = queue.get_experiment(engine, experiment_id=exp)
    assert view is not None and view.state == "queued" and view.started_at is None
    assert [(a["name"], a["is_baseline"]) for a in view.arms] == [("A", True), ("B", False)]
    assert view.versions == {"traind": "0.test", "torch": "2.13.0", "device": "cpu (test)"}
    assert len(view.config_hash) == 64 and view.objective["metric"] == "tokens_per_second"
    assert _claim(engine) is not None
    assert _state(engine, exp) == "running"
    verdict: dict[str, Any] = {"B": {"verdict": "better", "ratio": 1.07}}
    assert queue.finish_experiment(engine, experiment_id=exp, verdict=verdict)
    done = queue.get_experiment(engine, experiment_id=exp)
    assert done is not None and done.verdict == verdict and done.state == "done"
    assert done.finished_at is not None and done.finished_at.tzinfo is not None
    assert not queue.finish_experiment(engine, experiment_id=exp, verdict={})
    # Stopping early cancels what was left: the running trial and the unclaimed one.
    assert queue.queue_depth(engine)["cancelled"] == 2
    assert queue.cancel_experiment(engine, experiment_id=exp) == 0


@pytest.mark.parametrize(("kw", "field"), [
    ({"arms": [{"name": "A"}]}, "arms"),
    ({"arms": [{"name": "A"}, {"name": "A"}]}, r"arms\[1\]\.name"),
    ({"arms": [{"name": "A", "baseline": True}, {"name": "B", "baseline": True}]}, "arms"),
    ({"mode": "sideways"}, "mode"),
    ({"repeats": 0}, "repeats"),
])
def test_invalid_experiments_name_the_field_and_queue_nothing(
    engine: Engine, kw: dict[str, Any], field: str,
) -> None:
    args: dict[str, Any] = {
        "name": "bad", "mode": "forked", "base_config": {}, "budget": {"steps": 1},
        "arms": [{"name": "A"}, {"name": "B"}], **VERSIONS, **kw}
    with pytest.raises(ValueError, match=f"^{field}:"):
        queue.create_experiment(engine, **args)
    assert sum(queue.queue_depth(engine).values()) == 0


def test_sqlite_claim_runs_inside_begin_immediate(tmp_path: Path) -> None:
    """The driver's own BEGIN would come only before the UPDATE; ours must come first, and
    the pooled connection must get the driver's default transaction handling back."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    upgrade(url)
    eng = make_engine(url)
    _experiment(eng, repeats=1)
    seen: list[str] = []
    event.listen(eng, "before_cursor_execute",
                 lambda _c, _cur, stmt, *_a: seen.append(" ".join(stmt.split()[:2])))
    assert _claim(eng) is not None
    assert seen[0] == "BEGIN IMMEDIATE" and seen[-1] == "COMMIT"
    assert any(s.startswith("UPDATE trials") for s in seen)
    raw = eng.raw_connection()
    try:
        assert raw.driver_connection.isolation_level == ""  # type: ignore[union-attr]
    finally:
        raw.close()
    eng.dispose()
