"""The link matrix on /comm (web/linkviews.py, links_panel.html): a heat map of the probe's
rank-to-rank bandwidth, read from the exported gauges."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from traind.daemon.service import MetricSample
from traind.web.app import create_app
from traind.web.linkviews import heat, links_view

FAST, SLOW = 8e9, 1e8


def link_samples(run: str, n: int, slow: set[tuple[int, int]] = frozenset()) -> list[MetricSample]:
    out = [MetricSample("traind_link_probe_duration_seconds", {"run": run}, 0.042)]
    for src in range(n):
        for dst in range(n):
            if src != dst:
                lab = {"run": run, "src": str(src), "dst": str(dst)}
                bw = SLOW if (src, dst) in slow else FAST
                out += [MetricSample("traind_link_bandwidth_bytes_per_second", lab, bw),
                        MetricSample("traind_link_latency_seconds", lab, 2e-5)]
    return out


@pytest.mark.parametrize(("value", "lo", "hi", "want"), [
    (8e9, 1e8, 8e9, "hsl(120, 65%, 75%)"),  # the fastest: green
    (1e8, 1e8, 8e9, "hsl(0, 65%, 75%)"),  # the slowest: red
    (1e9, 1e8, 1e10, "hsl(60, 65%, 75%)"),  # half-way on a log scale
    (5e9, 5e9, 5e9, "hsl(120, 65%, 75%)"),  # all equal: all fast
    (4.56e8, 4.56e8, 4.7e8, "hsl(118, 65%, 75%)"),  # 3% apart (loopback): both green
    (1e9, 1e9, 2e9, "hsl(84, 65%, 75%)"),  # twice as slow: 30% of a decade towards red
    (float("nan"), 1e8, 8e9, "hsl(0, 0%, 80%)"),  # unknown: grey
    (0.0, 1e8, 8e9, "hsl(0, 0%, 80%)"),
])
def test_heat(value: float, lo: float, hi: float, want: str) -> None:
    assert heat(value, lo, hi) == want


def test_the_newest_run_with_links_as_a_matrix() -> None:
    slow = {(0, 2), (2, 0), (1, 3), (3, 1), (0, 3), (3, 0), (1, 2), (2, 1)}
    view = links_view([*link_samples("2", 2), *link_samples("10", 4, slow)])
    assert view is not None and view.run == "10"  # 10 after 2: numeric order
    assert view.ranks == ("0", "1", "2", "3")
    assert view.rows[0][0] is None  # a rank to itself
    assert view.rows[0][1] is not None and view.rows[0][1].bandwidth == "7.5 GiB/s"
    assert view.rows[0][1].latency == "20 \u00b5s"
    assert view.rows[0][1].color == "hsl(120, 65%, 75%)"
    assert view.rows[2][0] is not None and view.rows[2][0].color == "hsl(0, 65%, 75%)"
    assert view.spread == "80.0x" and view.probe == "42 ms"


def test_no_probe_no_matrix() -> None:
    assert links_view([MetricSample("traind_train_loss", {"run": "1", "rank": "0"}, 2.0)]) is None


def test_comm_page_draws_the_heat_map_outside_the_refreshed_panel(fake_service: Any) -> None:
    service = fake_service(metric_samples=link_samples("7", 2, {(1, 0)}))
    with TestClient(create_app(service, allowed_hosts=["testserver"])) as c:
        page = c.get("/comm").text
        fragment = c.get("/comm?fragment=1").text
    assert 'id="link-matrix"' in page and 'href="/runs/7"' in page
    assert 'style="background: hsl(120, 65%, 75%)"' in page  # 0 -> 1, the fast direction
    assert 'style="background: hsl(0, 65%, 75%)"' in page  # 1 -> 0, the slow one
    assert "fastest / slowest 80.0x" in page
    assert 'id="link-matrix"' not in fragment  # measured once: not refreshed
