"""Scheduled work queues behind a per-node concurrency limit: interleaved experiments run
one at a time by default (each is a job; at once they would measure each other)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tests.daemon.test_node import _node, _spec

if TYPE_CHECKING:
    from pathlib import Path


def test_interleaved_experiments_wait_their_turn(tmp_path: Path) -> None:
    node = _node(tmp_path)

    async def main() -> tuple[int, int]:
        first = await node.service.submit_experiment(_spec(name="first", steps=20))
        second = await node.service.submit_experiment(_spec(name="second", steps=20))
        assert first.state == "running" and first.run_id is not None
        assert second.state == "queued" and second.run_id is None  # the slot is taken
        assert len(node.supervisor.jobs) == 1
        deadline = asyncio.get_running_loop().time() + 240
        while (node.service.experiment(second.id).state != "done"  # type: ignore[union-attr]
               and asyncio.get_running_loop().time() < deadline):
            assert len(node.supervisor.jobs) <= 1  # never both at once
            await asyncio.sleep(0.2)
        return first.id, second.id

    first, second = asyncio.run(main())
    a, b = node.service.experiment(first), node.service.experiment(second)
    assert a is not None and b is not None
    assert a.state == "done" and b.state == "done", (a.state, b.state)
    # The second one's job began once the first's had ended.
    assert a.run_id is not None and b.run_id is not None and b.run_id > a.run_id
    runs = {r.id: r for r in node.service.runs()}
    ended, began = runs[a.run_id].finished_at, runs[b.run_id].started_at
    assert ended is not None and began is not None and began >= ended


def test_the_limit_is_the_configs(tmp_path: Path) -> None:
    node = _node(tmp_path, "daemon.max_experiment_jobs=2")

    async def main() -> None:
        infos = [await node.service.submit_experiment(_spec(name=f"e{i}", steps=20))
                 for i in range(3)]
        assert [i.state for i in infos] == ["running", "running", "queued"]
        await node.shutdown()

    asyncio.run(main())
