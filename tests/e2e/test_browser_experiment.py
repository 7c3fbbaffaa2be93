"""An A/B experiment from the form to its verdict, in Chromium against a real daemon."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import browser_log_in, watch_csp
from traind.daemon.experiments.stats import KINDS

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
FORM = 'form[action="/experiments"]'


def test_submit_an_experiment_and_read_its_verdict(daemon_factory: Any, browser: Any,
                                                   tmp_path: Path, output_dir: Path) -> None:
    d = daemon_factory(tmp_path, steps=1000, sets=("daemon.default_job=false",))
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    watch_csp(page, errors)  # a script or style the CSP blocked is an error too
    try:
        browser_log_in(page, d.url, (d.var_dir / "token").read_text().strip())
        page.goto(d.url + "/experiments")
        page.fill(f"{FORM} input[name=name]", "fp32-vs-bf16")
        page.fill(f"{FORM} input[name=steps]", "120")
        page.fill(f"{FORM} input[name=block_steps]", "10")
        page.select_option(f"{FORM} select[name=arm0_precision]", "fp32")
        page.select_option(f"{FORM} select[name=arm1_method]", "none")
        page.select_option(f"{FORM} select[name=arm1_precision]", "bf16")
        page.click(f"{FORM} button[type=submit]")
        page.wait_for_url("**/experiments/*")
        # The page reloads itself every 5 s until the job ends and the verdict is stored.
        page.wait_for_selector('#experiment[data-state="done"], '
                               '#experiment[data-state="failed"]', timeout=240_000)
        text = page.text_content("main") or ""
        assert page.get_attribute("#experiment", "data-state") == "done", text[:2000]
        assert any(kind in text for kind in KINDS), text[:2000]
        assert "bf16" in text and "fp32" in text
        shot = tmp_path / "experiment-verdict.png"
        page.screenshot(path=str(shot), full_page=True)
        shutil.copy(shot, output_dir / "experiment-verdict.png")
    finally:
        page.close()
    assert errors == []
