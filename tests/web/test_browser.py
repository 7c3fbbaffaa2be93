"""The overview in a real Chromium: charts draw the snapshot, then grow from live messages.

uvicorn serves the app on a free port in a background thread; a task on the server's own loop
publishes step messages to the hub, as the daemon's event receiver would.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from traind.web.app import create_app

RUN = 3
LOSS_POINTS = "document.getElementById('chart-loss').data?.[0]?.x?.length ?? 0"


async def trainer(service: Any, make_step: Any, make_eval: Any, first: int) -> None:
    """Publishes a step every 50 ms and an eval every 50 steps, until cancelled."""
    step = first
    while True:
        step += 1
        service.hub.publish(make_step(RUN, step))
        if step % 50 == 0:
            service.hub.publish(make_eval(RUN, step))
        await asyncio.sleep(0.05)


def test_overview_charts_stream(
    browser: Any, service: Any, live_server: Any, make_step: Any, make_eval: Any, tmp_path: Path
) -> None:
    # History before the page opens: what the snapshot draws first.
    for step in range(1, 201):
        service.hub.publish(make_step(RUN, step))
        if step % 50 == 0:
            service.hub.publish(make_eval(RUN, step))

    with live_server(create_app(service)) as server:
        publisher = asyncio.run_coroutine_threadsafe(
            trainer(service, make_step, make_eval, first=200), server.loop
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(server.url + "/")
            page.wait_for_function(f"{LOSS_POINTS} >= 200", timeout=20_000)
            first = page.evaluate(LOSS_POINTS)
            page.wait_for_function(f"{LOSS_POINTS} > {first}", timeout=10_000)
            assert page.evaluate("document.getElementById('chart-loss').data[1].x.length") >= 4
            assert page.evaluate("document.getElementById('chart-tps').data[0].x.length") > 200
            assert page.evaluate("document.getElementById('chart-gradnorm').data[0].x.length") > 0
            assert page.text_content("#conn") == "live"
            assert page.text_content("[data-field=name]") == "gpt-small-bf16"

            page.wait_for_timeout(600)  # let a flush land so the header shows fresh numbers
            shot = tmp_path / "overview.png"
            page.screenshot(path=str(shot), full_page=True)
            save_artifact(shot, "overview.png")

            # A new run id in a message starts the charts afresh and renames the header.
            publisher.cancel()
            service.run_views.insert(0, replace(service.run_views[0], id=RUN + 1, name="next"))
            for step in (1, 2):
                server.loop.call_soon_threadsafe(service.hub.publish, make_step(RUN + 1, step))
            page.wait_for_function(f"{LOSS_POINTS} === 2", timeout=10_000)
            page.wait_for_function(
                "document.querySelector('[data-field=name]').textContent === 'next'",
                timeout=10_000,
            )
            assert page.evaluate("document.getElementById('chart-loss').data[1].x.length") == 0
            assert page.text_content("[data-field=id]") == f"#{RUN + 1}"

            page.goto(server.url + "/runs")
            page.click("details summary")  # open the failed run's log for the picture
            shot = tmp_path / "runs.png"
            page.screenshot(path=str(shot), full_page=True)
            save_artifact(shot, "runs.png")
        finally:
            page.close()
            publisher.cancel()
    assert errors == []


def save_artifact(src: Path, name: str) -> None:
    """Copy to <repo>/test-output (git-ignored), where people can look at it."""
    out = Path(__file__).resolve().parents[2] / "test-output"
    out.mkdir(exist_ok=True)
    (out / name).write_bytes(src.read_bytes())


def test_hardware_and_comm_pages(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    with live_server(create_app(service)) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(server.url + "/hardware")
            assert page.locator(".gpu-card").count() == 2
            assert "SW power cap" in (page.text_content("#gpu-1 .throttles") or "")
            page.screenshot(path=str(output_dir / "hardware.png"), full_page=True)

            page.goto(server.url + "/comm")
            chart_traces = "document.getElementById('chart-busbw').data?.length ?? 0"
            page.wait_for_function(f"{chart_traces} === 2", timeout=10_000)
            # Mark the chart's node: the refresh must keep it (zoom and all), not redraw anew.
            page.evaluate("document.getElementById('chart-busbw').dataset.marked = 'yes'")
            page.screenshot(path=str(output_dir / "comm.png"), full_page=True)

            # New numbers from the service show up without a reload (refresh.js, every 5 s).
            service.metric_samples = [
                replace(s, value=99_000) if s.name == "traind_comm_buckets_total" else s
                for s in service.metric_samples
            ]
            page.wait_for_function(
                "document.getElementById('comm-table').textContent.includes('99,000')",
                timeout=12_000,
            )
            assert page.evaluate("document.getElementById('chart-busbw').dataset.marked") == "yes"
            assert page.evaluate(chart_traces) == 2
            assert page.text_content("#conn") == "live"
        finally:
            page.close()
    assert errors == []
