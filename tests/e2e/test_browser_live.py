"""The whole path in a real browser: `traind serve` trains, Chromium watches the loss chart grow."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import wait_until, watch_csp

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
LOSS_POINTS = "document.getElementById('chart-loss').data?.[0]?.x?.length ?? 0"


def test_overview_loss_chart_gains_points(daemon: Any, browser: Any, tmp_path: Path,
                                          output_dir: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    watch_csp(page, errors)  # a script or style the CSP blocked is an error too
    try:
        # The one-time link `traind serve` wrote (as a user opens it from var/login-url): the
        # live feed needs a session. Its host is the bind address, 127.0.0.1, like daemon.url.
        link = (daemon.var_dir / "login-url").read_text().strip()
        assert link.startswith(daemon.url + "/login?token=")
        page.goto(link)
        assert page.url == daemon.url + "/", page.url
        page.goto(daemon.url + "/")
        wait_until(page, f"{LOSS_POINTS} > 0", timeout=60_000)
        first = page.evaluate(LOSS_POINTS)
        wait_until(page, f"{LOSS_POINTS} > {first} + 10", timeout=30_000)
        page.wait_for_timeout(1000)
        shot = tmp_path / "overview-live.png"
        page.screenshot(path=str(shot), full_page=True)
        shutil.copy(shot, output_dir / "overview-live.png")
        assert page.text_content("#conn") == "live"
        page.goto(daemon.url + "/runs")
        assert "e2e" in page.text_content("table")
    finally:
        page.close()
    assert errors == []
