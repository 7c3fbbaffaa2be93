"""Nothing the daemon does grows without bound with its data: restarts resume every piece of
work however much there is, and the pages render one page of each list."""

from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time
import tracemalloc
from typing import TYPE_CHECKING, Any

import httpx
import psutil

from tests.daemon.test_node import _node
from tests.metrics.test_retention import run_events
from tests.web.conftest import LiveServer
from traind.daemon.db import queue
from traind.daemon.runs.jobs import JobExit
from traind.web.app import create_app

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from traind.contracts.events import Event
    from traind.daemon.node import Node


def _forked(node: Node, n: int, *, repeats: int = 1) -> list[int]:
    return [queue.create_experiment(
        node.engine, name=f"e{i}", mode="forked", base_config={}, budget={"steps": 10},
        arms=[{"name": "a"}, {"name": "b"}], repeats=repeats, traind_version="t",
        torch_version="t", device="cpu") for i in range(n)]


def test_every_unfinished_forked_experiment_resumes_after_a_restart(tmp_path: Path) -> None:
    # The restart path once read the newest 200 only: with 500 queued, 300 never ran.
    node = _node(tmp_path)
    ids = _forked(node, 500)
    queue.cancel_experiment(node.engine, experiment_id=ids[0])
    assert node.experiment_service.unfinished_forked() == ids[1:]


def test_lists_come_a_page_at_a_time(tmp_path: Path) -> None:
    node = _node(tmp_path)
    ids = _forked(node, 120)
    newest = node.service.experiments(limit=50)
    assert [e.id for e in newest] == ids[::-1][:50]
    assert [e.id for e in node.service.experiments(limit=50, offset=100)] == ids[::-1][100:]
    waiting = node.service.queued_trials(limit=1000)
    assert len(waiting) == 240 and waiting[0].experiment == "e0"
    assert [t.id for t in node.service.queued_trials(limit=10, offset=5)] == [t.id for t in
                                                                      waiting[5:15]]


def test_healthz_answers_while_the_experiments_page_shows_10000_queued_trials(
        tmp_path: Path) -> None:
    node = _node(tmp_path)
    _forked(node, 5, repeats=1000)  # 10,000 waiting trials
    app = create_app(node.service, allowed_hosts=["127.0.0.1"])
    node._ready = True
    stop = threading.Event()
    sizes: list[int] = []

    def reader(url: str) -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                sizes.append(len(c.get(url + "/experiments").content))

    with LiveServer(app) as server:
        readers = [threading.Thread(target=reader, args=(server.url,)) for _ in range(2)]
        for t in readers:
            t.start()
        latencies = []
        try:
            with httpx.Client(timeout=10) as c:
                for _ in range(30):
                    start = time.perf_counter()
                    assert c.get(server.url + "/healthz").status_code == 200
                    latencies.append(time.perf_counter() - start)
                    time.sleep(0.05)
        finally:
            stop.set()
            for t in readers:
                t.join()
    assert sizes, "the page was never rendered"
    # One page of the queue: the page stays small however long the queue is.
    assert max(sizes) < 300_000, max(sizes)
    print(f"page {max(sizes)} bytes; healthz median {statistics.median(latencies) * 1e3:.1f} ms, "
          f"max {max(latencies) * 1e3:.1f} ms over {len(latencies)}")
    assert statistics.median(latencies) < 0.1, latencies


class ScriptedJob:
    """Stands in for torchrun's workers (``Supervisor.job_factory``): at start it sends one
    short 2-rank run's events, each family's series touched, and exits 0. Fifty real launches
    would cost minutes; what is measured here is what the daemon keeps per run."""

    def __init__(self, cfg: Any, out_dir: Path, on_event: Callable[[Event], None],
                 **_: Any) -> None:
        self.out_dir, self._on_event = out_dir, on_event
        self.pid, self.bad_events = 0, 0
        self._done = asyncio.Event()

    async def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._play)

    def _play(self) -> None:
        for event in run_events(world=2, steps=2):
            self._on_event(event)
        self._done.set()

    async def wait(self) -> JobExit:
        await self._done.wait()
        return JobExit(code=0, stopped=False, log_tail="")

    async def stop(self) -> None:
        self._done.set()

    def worker_pids(self) -> list[int]:
        return []


def test_fifty_runs_through_one_daemon_leave_its_metrics_and_memory_as_they_were(
        tmp_path: Path) -> None:
    retention = 0.05
    node = _node(tmp_path, f"metrics.series_retention_seconds={retention}")
    node.supervisor.job_factory = ScriptedJob

    def series() -> int:
        body, _ = node.service.metrics_exposition(None)
        return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))

    async def go() -> tuple[list[int], list[int], list[int]]:
        counts, heap, rss = [], [], []
        me = psutil.Process()
        for i in range(50):
            await node.submit(node.settings)
            await asyncio.wait(node.supervisor.tasks | node.interleaved.tasks, timeout=30)
            await asyncio.sleep(retention * 2)  # past the retention: the run is forgotten
            node.flusher.flush()  # the flush loop's turn (it is not running here)
            counts.append(series())
            if i in (24, 49):  # after run 25 and after run 50
                gc.collect()
                heap.append(tracemalloc.get_traced_memory()[0])
                rss.append(me.memory_info().rss)
        return counts, heap, rss

    tracemalloc.start()
    try:
        counts, heap, rss = asyncio.run(go())
    finally:
        tracemalloc.stop()
    # Every run's series left /metrics: the count is what it was after the first run.
    assert counts[-1] <= counts[0] and max(counts) <= counts[0], counts
    assert not node.supervisor.summaries and not node.hub._steps  # nothing per run is held
    # Python's heap after run 50 is where it was after run 25 (each run held tens of KiB
    # before: its series, summary and live points); the RSS follows, within the allocator's
    # own slack.
    assert heap[1] - heap[0] < 256 * 1024, [h // 1024 for h in heap]
    assert rss[1] - rss[0] < 16 * 2**20, [r // 2**20 for r in rss]
