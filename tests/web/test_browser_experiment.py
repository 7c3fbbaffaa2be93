"""An experiment's page in a real Chromium (its verdict with the test behind it, each arm's
means and per-block throughput, progress, a confirmed cancel), and what each page weighs."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tests.conftest import browser_log_in, wait_until, watched_page
from tests.web.test_browser_run import transferred
from tests.web.test_experiments import abba_blocks
from traind.daemon.service import ExperimentInfo
from traind.web.app import create_app

if TYPE_CHECKING:
    from pathlib import Path

BLOCKS = "document.getElementById('chart-blocks')"


def _running(service: Any) -> ExperimentInfo:
    from tests.web.conftest import T0

    info = ExperimentInfo(
        id=1, name="int8 vs none", state="running", mode="interleaved",
        arms=("none", "int8"), run_id=3, config_hash="0000beef",
        versions={"traind": "0.1.0", "torch": "2.13.0"}, created_at=T0, finished_at=None,
        verdict={"int8": {
            "kind": "running", "pairs": 12, "ratio": 1.2, "low": 0.98, "high": 1.45,
            "p_value": 0.13, "interval": "95% always-valid confidence sequence",
            "reason": "int8: 1.200x so far (12 pairs, always-valid p 0.13)"}})
    service.experiment_infos[1] = info
    service.measurements[1] = abba_blocks(("none", "int8"), 12,
                                          {"none": 1000.0, "int8": 1200.0})
    return info


def test_an_experiments_page_draws_its_blocks_and_cancel_asks_first(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    _running(service)
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        browser_log_in(page, server.url, service.token)
        page.goto(server.url + "/experiments/1")
        wait_until(page, f"{BLOCKS} && {BLOCKS}.data && {BLOCKS}.data.length === 2")
        assert page.evaluate(f"{BLOCKS}.data.map((t) => t.name)") == [
            "none (baseline)", "int8"]
        assert page.evaluate(f"{BLOCKS}.data[1].y.length") == 12
        assert page.evaluate("document.getElementById('chart-verdict').data.length") == 1
        assert "12 of 30 pairs" in page.text_content("#progress")
        assert page.evaluate("document.querySelector('#progress progress').value") == 40
        assert page.text_content("#interval-note").startswith(
            "Interval: 95% always-valid confidence sequence")
        page.screenshot(path=str(output_dir / "experiment-running.png"), full_page=True)

        # Cancel asks first: dismissed, nothing happens; accepted, it is cancelled and the
        # page says so at once (the job stops at its next step boundary, not waited for).
        page.once("dialog", lambda d: d.dismiss())
        page.click("#cancel-form button")
        page.wait_for_timeout(300)
        assert service.experiment(1).state == "running"
        page.once("dialog", lambda d: d.accept())
        t0 = time.monotonic()
        with page.expect_navigation():
            page.click("#cancel-form button")
        took = time.monotonic() - t0
        assert service.experiment(1).state == "cancelled"
        assert page.text_content("#experiment .badge") == "cancelled"
        assert page.text_content("#verdict-0 .badge") == "cancelled"
        assert "the experiment was cancelled before int8 was decided" in page.text_content(
            "#verdict-0")
        assert page.query_selector("#cancel-form") is None
        page.screenshot(path=str(output_dir / "experiment-cancelled.png"), full_page=True)
    assert errors == []
    print(f"cancel confirmed and shown in {took:.2f} s")


def test_what_each_page_weighs_cold_and_warm(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    """Bytes over the wire and load time of every page, cold (empty cache) and warm (a
    reload), written to test-output/page-weights.txt for the notes; warm must come from the
    cache (no static asset fetched again)."""
    _running(service)
    service.finish(1, {"int8": {**service.experiment_infos[1].verdict["int8"],
                                "kind": "no difference"}})
    service.experiment_infos[1] = replace(service.experiment_infos[1], state="done")
    pages = ("/", "/runs", "/runs/3", "/experiments", "/experiments/1", "/hardware", "/comm",
             "/api/docs")
    lines = []
    with live_server(create_app(service)) as server:
        for path in pages:
            with watched_page(browser, 1440, 900) as (page, errors):
                t0 = time.monotonic()
                page.goto(server.url + path, wait_until="load")
                cold_s = time.monotonic() - t0
                cold = transferred(page, cold=True)
                t0 = time.monotonic()
                page.reload(wait_until="load")
                warm_s = time.monotonic() - t0
                warm = transferred(page)
                static = page.evaluate(
                    "performance.getEntriesByType('resource')"
                    ".filter((e) => e.name.includes('/static/'))"
                    ".map((e) => e.transferSize)")
                assert not static or max(static) < 1000, (path, static)
            assert errors == [], (path, errors)
            lines.append(f"{path:16} cold {cold / 1e3:8,.0f} kB {cold_s:5.2f} s   "
                         f"warm {warm / 1e3:6,.0f} kB {warm_s:5.2f} s")
    (output_dir / "page-weights.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
