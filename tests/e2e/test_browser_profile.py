"""A profile on demand, as a user takes one: a real daemon trains a real 2-rank gloo job, the
run page's Profile button asks for three steps, the report page reloads until the ranks'
traces are analysed, and its figures are checked against the trace the page lets one
download (issue 17)."""

from __future__ import annotations

import gzip
import json
import re
import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import browser_log_in, watched_page

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.conftest import DaemonProc

pytestmark = pytest.mark.slow
STEPS = 3


def _training(d: DaemonProc, run_id: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = d.get(f"/api/runs/{run_id}").json()
        if run.get("state") == "running" and run["summary"].get("step", 0) > 2:
            return
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} did not start training:\n{d.log.read_text()[-3000:]}")


def _merged_length(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``spans`` (written here, not imported: the check must
    not share the analysis' code)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def test_the_profile_button_traces_three_steps_and_reports_what_the_trace_holds(
    daemon_factory: Callable[..., DaemonProc], browser: Any, tmp_path: Path,
    output_dir: Path
) -> None:
    d = daemon_factory(tmp_path, steps=100_000, sets=("job.nproc_per_node=2",))
    _training(d)
    with watched_page(browser, 1440, 900) as (page, errors):
        browser_log_in(page, d.url, (d.var_dir / "token").read_text().strip())
        page.goto(d.url + "/runs/1")
        page.fill("#profile-form input[name=steps]", str(STEPS))
        with page.expect_navigation():
            page.click("#profile-button")
        assert page.url.endswith("/runs/1/profiles/1"), page.url
        # the page reloads itself every 2 s until the report is built
        page.wait_for_selector("#profile[data-state=ready]", timeout=90_000)
        page.wait_for_selector("#chart-memory .main-svg", timeout=10_000)
        page.screenshot(path=str(output_dir / "profile-report.png"), full_page=True)

        rows = page.query_selector_all("#breakdown-table tbody tr")
        assert [r.get_attribute("data-rank") for r in rows] == ["0", "1"]
        shown = {int(r.get_attribute("data-rank")): {
            "window": float(r.get_attribute("data-window-ms")),
            "comm": float(r.get_attribute("data-comm-ms")),
            "parts": [float(c.get_attribute("data-ms"))
                      for c in r.query_selector_all("td[data-key]")]} for r in rows}
        top = page.text_content(".ops-rank[data-rank='0'] .ops-table tbody tr td.op-name")
        arrivals = len(page.query_selector_all("#arrival-table tbody tr"))
        trace_href = page.get_attribute("#breakdown-table tr[data-rank='0'] a.trace-link",
                                        "href")
        assert errors == []

    # The figures against rank 0's trace, downloaded as the page's link does.
    assert trace_href == "/api/runs/1/profiles/1/traces/0"
    got = d.get(trace_href)
    assert got.status_code == 200 and got.headers["content-type"] == "application/gzip"
    trace = json.loads(gzip.decompress(got.content))
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks = {int(m.group(1)): (e["ts"], e["ts"] + e["dur"]) for e in spans
             if (m := re.match(r"traind\.step#(\d+)$", e["name"]))}
    assert len(marks) == STEPS and sorted(marks) == list(range(min(marks), min(marks) + STEPS))
    window_ms = sum(e - s for s, e in marks.values()) / 1e3
    assert shown[0]["window"] == pytest.approx(window_ms, rel=1e-9)
    # communication: gloo's all-reduce spans (and the ProcessGroup's ops) inside the steps
    comm = [(max(e["ts"], s), min(e["ts"] + e["dur"], end)) for e in spans
            if re.match(r"(gloo:|c10d::)", e["name"])
            for s, end in marks.values() if e["ts"] < end and e["ts"] + e["dur"] > s]
    assert comm, "a DDP step all-reduces its gradients"
    assert shown[0]["comm"] == pytest.approx(_merged_length(comm) / 1e3, rel=1e-6)
    # the buckets of the bar add up to the traced time
    assert sum(shown[0]["parts"]) == pytest.approx(window_ms, rel=1e-6)
    # the top operator ran inside the traced steps
    assert top and any(e["name"] == top for e in spans)
    # every traced step's arrival at its first collective, for both ranks
    assert arrivals == STEPS
    api = d.get("/api/runs/1/profiles/1").json()
    assert api["capture"]["state"] == "ready" and api["capture"]["traces"] == [0, 1]
    assert api["report"]["steps"] == sorted(marks)

    # The CLI takes the next one, waits, prints the split and downloads the traces.
    from typer.testing import CliRunner

    from traind.cli.main import app

    result = CliRunner().invoke(app, [
        "profile", "1", "--steps", "2", "--ranks", "1", "--url", d.url,
        "--token-file", str(d.var_dir / "token"), "--out", str(tmp_path / "traces")],
        env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "profile 2 asked (2 steps, ranks 1)" in result.output
    assert "Where the traced steps' time went" in result.output
    assert "/runs/1/profiles/2" in result.output
    saved = tmp_path / "traces" / "run1-profile2-rank1.json.gz"
    assert len(json.loads(gzip.decompress(saved.read_bytes()))["traceEvents"]) > 100
    assert not (tmp_path / "traces" / "run1-profile2-rank0.json.gz").exists()
