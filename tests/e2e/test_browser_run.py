"""A finished run's page after the daemon restarted: its curves come from the database, not
from the memory of the daemon that trained it (issue 15)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import stop_daemon, wait_until, watch_csp

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.conftest import DaemonProc

pytestmark = pytest.mark.slow
STEPS = 60


def _finished(d: DaemonProc, run_id: int, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = d.get(f"/api/runs/{run_id}")
        if r.status_code == 200 and r.json()["state"] not in ("queued", "running"):
            return r.json()
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} did not finish within {timeout:.0f} s")


def test_a_finished_runs_page_after_a_daemon_restart(
    daemon_factory: Callable[..., DaemonProc], browser: Any, tmp_path: Path, output_dir: Path
) -> None:
    first = daemon_factory(tmp_path, steps=STEPS)
    assert _finished(first, 1)["state"] == "completed"
    stop_daemon(first)
    again = daemon_factory(tmp_path, steps=STEPS)  # the same database, a new process
    series = again.get("/api/runs/1/series").json()
    assert series["points"] == STEPS and series["step"][-1] == STEPS
    assert series["evals"]["step"] == [20, 40, 60]
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    watch_csp(page, errors)
    try:
        page.goto((again.var_dir / "login-url").read_text().strip())
        page.goto(again.url + "/runs/1")
        wait_until(page, f"document.getElementById('run').dataset.points === '{STEPS}'",
                   timeout=20_000)
        assert page.evaluate("document.getElementById('chart-loss').data"
                             ".find((t) => t.name === 'train loss').x.length") == STEPS
        assert page.evaluate("document.getElementById('chart-loss').data"
                             ".find((t) => t.name === 'val loss').x.length") == 3
        assert not page.is_hidden("#layers-card")  # per-layer norms were stored too
        assert "completed" in page.text_content("#run-state")
        assert "finished" in page.text_content("#run-events")
        page.screenshot(path=str(output_dir / "run-page-after-restart.png"), full_page=True)
        csv = again.get("/api/runs/1/series.csv")
        assert csv.status_code == 200 and len(csv.text.strip().splitlines()) == STEPS + 1
    finally:
        page.close()
    assert errors == []
