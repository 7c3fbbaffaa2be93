"""Nothing the daemon does grows without bound with its data: restarts resume every piece of
work however much there is, and the pages render one page of each list."""

from __future__ import annotations

import statistics
import threading
import time
from typing import TYPE_CHECKING

import httpx

from tests.daemon.test_node import _node
from tests.web.conftest import LiveServer
from traind.daemon import queue
from traind.web.app import create_app

if TYPE_CHECKING:
    from pathlib import Path

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
    newest = node.experiments(limit=50)
    assert [e.id for e in newest] == ids[::-1][:50]
    assert [e.id for e in node.experiments(limit=50, offset=100)] == ids[::-1][100:]
    waiting = node.queued_trials(limit=1000)
    assert len(waiting) == 240 and waiting[0].experiment == "e0"
    assert [t.id for t in node.queued_trials(limit=10, offset=5)] == [t.id for t in
                                                                      waiting[5:15]]


def test_healthz_answers_while_the_experiments_page_shows_10000_queued_trials(
        tmp_path: Path) -> None:
    node = _node(tmp_path)
    _forked(node, 5, repeats=1000)  # 10,000 waiting trials
    app = create_app(node, allowed_hosts=["127.0.0.1"])
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
