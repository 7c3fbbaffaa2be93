"""Run events survive a database that refuses writes: held, spilled past a bound, written
once it accepts them again; nothing lost, nothing written twice."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from traind.daemon.ingest.event_buffer import EventBuffer

if TYPE_CHECKING:
    from pathlib import Path


class Store:
    """A database that refuses writes while ``down``."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []
        self.down = False

    def write(self, run_id: int, events: list[dict[str, Any]]) -> None:
        if self.down:
            raise OSError("attempt to write a readonly database")
        self.rows += [(run_id, e["step"]) for e in events]


def test_events_wait_while_the_store_refuses_and_arrive_in_order(tmp_path: Path) -> None:
    buf, store = EventBuffer(tmp_path / "spill.jsonl"), Store()
    store.down = True
    for step in range(5):
        buf.add(1, {"kind": "eval", "step": step})
        buf.add(2, {"kind": "eval", "step": step})
        with pytest.raises(OSError):
            buf.flush(store.write)
    assert buf.pending == 10 and store.rows == []
    store.down = False
    buf.add(1, {"kind": "eval", "step": 5})
    buf.flush(store.write)
    assert buf.pending == 0
    assert [s for r, s in store.rows if r == 1] == [0, 1, 2, 3, 4, 5]
    assert [s for r, s in store.rows if r == 2] == [0, 1, 2, 3, 4]


def test_past_the_bound_events_spill_to_a_file_and_come_back(tmp_path: Path) -> None:
    spill = tmp_path / "spill.jsonl"
    buf, store = EventBuffer(spill, limit=100), Store()
    store.down = True
    for step in range(1000):
        buf.add(step % 3, {"kind": "x", "step": step})
    assert spill.exists() and buf.pending == 1000
    assert buf._count <= 100  # memory stays bounded
    with pytest.raises(OSError):
        buf.flush(store.write)
    store.down = False
    buf.flush(store.write)
    assert sorted(s for _, s in store.rows) == list(range(1000))
    assert len(store.rows) == 1000 and not spill.exists() and buf.pending == 0


def test_a_replay_that_fails_halfway_writes_nothing_twice(tmp_path: Path) -> None:
    spill = tmp_path / "spill.jsonl"
    buf = EventBuffer(spill, limit=1)
    for step in range(4):
        buf.add(step % 2, {"kind": "x", "step": step})  # runs 0 and 1, spilled
    store, calls = Store(), []

    def flaky(run_id: int, events: list[dict[str, Any]]) -> None:
        calls.append(run_id)
        if len(calls) == 2:
            raise OSError("went read-only between two runs")
        store.write(run_id, events)

    with pytest.raises(OSError):
        buf.flush(flaky)
    buf.flush(store.write)
    assert sorted(s for _, s in store.rows) == [0, 1, 2, 3]


def test_a_restarted_daemon_finds_what_was_spilled(tmp_path: Path) -> None:
    spill = tmp_path / "spill.jsonl"
    buf = EventBuffer(spill, limit=1)
    for step in range(3):
        buf.add(7, {"kind": "x", "step": step})
    again, store = EventBuffer(spill), Store()
    assert again.pending >= 2
    again.flush(store.write)
    assert [s for _, s in store.rows][:2] == [0, 1]


def test_a_read_only_postgresql_loses_no_event_and_the_api_says_503(
        tmp_path: Path, postgres_url: str) -> None:
    import psycopg
    from fastapi.testclient import TestClient

    from tests.daemon.test_node import _node
    from traind.daemon.db import crud
    from traind.web.app import create_app

    admin = postgres_url.replace("postgresql+psycopg", "postgresql").rsplit("/", 1)[0]
    with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS traind_ro")
        conn.execute("CREATE DATABASE traind_ro")
    url = postgres_url.rsplit("/", 1)[0] + "/traind_ro"

    def read_only(on: bool) -> None:
        with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE traind_ro SET default_transaction_read_only = "
                         f"{'on' if on else 'off'}")
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = 'traind_ro'")  # pooled sessions pick it up anew

    node = _node(tmp_path, f"daemon.db_url={url}")
    try:
        run_id = crud.create_run(node.engine, name="r", config={})
        read_only(True)
        for step in range(1, 51):
            node.events.add(run_id, {"kind": "eval", "step": step, "value": 1.0})
        for _ in range(3):
            with pytest.raises(Exception, match="read-only"):
                node.flusher.flush()
        assert node.events.pending == 50
        with TestClient(create_app(node.service, allowed_hosts=["testserver"])) as c:
            r = c.get("/api/experiments")  # a read of a read-only database still works
            assert r.status_code == 200
            from traind.daemon.service import ExperimentSpec
            with pytest.raises(Exception, match="read-only"):
                asyncio.run(node.service.submit_experiment(ExperimentSpec(
                    name="e", steps=80, arms=({"name": "a"}, {"name": "b"}))))
            r = c.post("/api/experiments", headers={"Authorization": f"Bearer {node.token}"},
                       json={"name": "e", "steps": 80, "arms": [{"name": "a"}, {"name": "b"}]})
            assert r.status_code == 503 and "try again" in r.json()["detail"], r.text
        read_only(False)
        node.flusher.flush()
        assert node.events.pending == 0
        stored = crud.run_events(node.engine, run_id=run_id, kind="eval")
        assert [e["step"] for e in stored] == list(range(1, 51))
    finally:
        read_only(False)
        node.engine.dispose()
