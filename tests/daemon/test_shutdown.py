"""Once the daemon is stopping it starts nothing new, and the work it did not start stays
queued for the next start (a forked trial was once started during shutdown, then killed)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest
from fastapi.testclient import TestClient

from tests.daemon.test_node import _node
from traind.daemon.db import crud, queue
from traind.daemon.service import ExperimentSpec, ShuttingDown
from traind.web.app import create_app

if TYPE_CHECKING:
    from pathlib import Path


def test_a_stopping_daemon_launches_nothing_and_says_503(tmp_path: Path) -> None:
    node = _node(tmp_path)
    node.supervisor.stopping = True
    with pytest.raises(ShuttingDown):
        asyncio.run(node.submit(node.settings))
    assert crud.list_runs(node.engine) == []
    with TestClient(create_app(node.service, allowed_hosts=["testserver"])) as c:
        r = c.post("/api/experiments", headers={"Authorization": f"Bearer {node.token}"},
                   json={"name": "e", "steps": 10, "arms": [{"name": "a"}, {"name": "b"}]})
    assert r.status_code == 503 and "shutting down" in r.json()["detail"]
    assert node.service.experiments() == []


def test_a_forked_runner_that_meets_the_shutdown_leaves_its_experiment_queued(
        tmp_path: Path) -> None:
    node = _node(tmp_path)
    spec = ExperimentSpec(name="f", steps=10, mode="forked", arms=({"name": "a"}, {"name": "b"}),
                          block_steps=5)

    async def main() -> None:
        start = node.forked.start
        node.forked.start = lambda _id: None  # type: ignore[method-assign]  (held back)
        info = await node.service.submit_experiment(spec)
        node.supervisor.stopping = True  # SIGTERM arrives before its first job starts
        start(info.id)
        await node.forked.wait(info.id)

    asyncio.run(main())
    (view,) = queue.list_experiments(node.engine)
    assert view.state in ("queued", "running"), view.state  # not failed: the next start runs it
    assert node.experiment_service.unfinished_forked() == [view.id]
    assert crud.list_runs(node.engine) == []
