"""The overview in a real Chromium: charts draw the snapshot, then grow from live messages.

uvicorn serves the app on a free port in a background thread; a task on the server's own loop
publishes step messages to the hub, as the daemon's event receiver would.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.conftest import browser_log_in, wait_until, watch_csp, watched_page
from tests.web.conftest import synthetic_columns
from traind.daemon.ingest.hub import EventHub
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
        watch_csp(page, errors)  # a script or style the CSP blocked is an error too
        try:
            browser_log_in(page, server.url, service.token)  # the live feed needs a session
            page.goto(server.url + "/")
            wait_until(page, f"{LOSS_POINTS} >= 200", timeout=20_000)
            first = page.evaluate(LOSS_POINTS)
            wait_until(page, f"{LOSS_POINTS} > {first}", timeout=10_000)
            assert page.evaluate("document.getElementById('chart-loss').data[1].x.length") >= 4
            assert page.evaluate("document.getElementById('chart-tps').data[0].x.length") > 200
            assert page.evaluate("document.getElementById('chart-gradnorm').data[0].x.length") > 0
            assert page.text_content("#conn") == "live"
            assert page.text_content("[data-field=name]") == "gpt-small-bf16"

            page.wait_for_timeout(600)  # let a flush land so the header shows fresh numbers
            shot = tmp_path / "overview.png"
            page.screenshot(path=str(shot), full_page=True)
            save_artifact(shot, "overview.png")

            # Another run starts beside it: the page stays on its run (issue 15: it used to
            # jump to the newest run's messages and wipe the charts)...
            publisher.cancel()
            page.wait_for_timeout(600)  # its last steps drawn
            held = page.evaluate(LOSS_POINTS)
            service.run_views.insert(0, replace(service.run_views[0], id=RUN + 1, name="next"))
            for step in (1, 2, 3):
                server.loop.call_soon_threadsafe(service.hub.publish, make_step(RUN + 1, step))
            page.wait_for_timeout(800)  # a few flushes' worth
            assert page.evaluate(LOSS_POINTS) == held
            assert page.text_content("[data-field=id]") == f"#{RUN}"
            assert page.text_content("[data-field=name]") == "gpt-small-bf16"
            # ...and after a reload, with two runs training, a picker follows the other one
            page.reload()
            wait_until(page, f"{LOSS_POINTS} >= 200", timeout=20_000)
            assert page.text_content("[data-field=id]") == f"#{RUN}"
            page.select_option("#run-picker", str(RUN + 1))
            page.wait_for_url(f"**/?run={RUN + 1}", timeout=10_000)
            wait_until(page, f"{LOSS_POINTS} === 3", timeout=10_000)
            assert page.text_content("[data-field=id]") == f"#{RUN + 1}"
            assert page.evaluate("document.getElementById('chart-loss').data[1].x.length") == 0
            shot = tmp_path / "overview-picker.png"
            page.screenshot(path=str(shot), full_page=True)
            save_artifact(shot, "overview-picker.png")

            page.goto(server.url + "/runs")
            page.click("details summary")  # open the failed run's log for the picture
            shot = tmp_path / "runs.png"
            page.screenshot(path=str(shot), full_page=True)
            save_artifact(shot, "runs.png")
        finally:
            page.close()
            publisher.cancel()
    assert errors == []


TIMELINE = "document.getElementById('chart-precision').data"


def _window(run: int, step: int, modes: list[str]) -> dict[str, Any]:
    """The hub's ``snr`` message for one adaptive-precision window (as daemon.node sends)."""
    return {"type": "snr", "run": run, "step": step, "groups": ["block.0", "block.1", "head"],
            "snr": [step / 4, 2.0, None], "modes": modes}  # None: a NaN/inf SNR


def _switch(run: int, step: int, group: str, before: str, after: str) -> dict[str, Any]:
    return {"type": "precision", "run": run, "step": step, "group": group, "before": before,
            "after": after, "snr": 9.0}


def test_overview_after_a_reload_draws_the_stored_history_before_the_buffer(
    browser: Any, service: Any, live_server: Any, make_step: Any, output_dir: Path
) -> None:
    service.hub = EventHub(capacity=50)  # the buffer holds only steps 251-300 of 300
    for step in range(1, 301):
        service.hub.publish(make_step(RUN, step))
    service.step_columns[RUN] = synthetic_columns(service.run_views[0], steps=290)  # stored
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1280, 900) as (page, errors)):
        browser_log_in(page, server.url, service.token)
        page.goto(server.url + "/")
        wait_until(page, f"{LOSS_POINTS} === 300", timeout=20_000)
        xs = page.evaluate("document.getElementById('chart-loss').data[0].x")
        assert xs == list(range(1, 301))  # stored 1-250, then the buffer's 251-300
        assert page.text_content("#conn") == "live"
    assert errors == []


def test_the_overviews_chart_tools_work_while_it_streams(
    browser: Any, service: Any, live_server: Any, make_step: Any, make_eval: Any,
    output_dir: Path
) -> None:
    """Smoothing (the raw line kept faint), x by wall or relative time, log y and linked zoom,
    on the live charts: new points keep arriving into the view the tools chose."""
    for step in range(1, 201):
        service.hub.publish(make_step(RUN, step))
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1280, 900) as (page, errors)):
        publisher = asyncio.run_coroutine_threadsafe(
            trainer(service, make_step, make_eval, first=200), server.loop)
        try:
            browser_log_in(page, server.url, service.token)
            page.goto(server.url + "/")
            wait_until(page, f"{LOSS_POINTS} >= 200", timeout=20_000)
            page.fill("#smoothing", "0.9")
            page.dispatch_event("#smoothing", "input")
            names = "document.getElementById('chart-loss').data.map((t) => t.name)"
            assert page.evaluate(names) == ["train loss (raw)", "train loss", "val loss"]
            raw = "document.getElementById('chart-loss').data[0]"
            smooth = "document.getElementById('chart-loss').data[1]"
            assert page.evaluate(f"{raw}.y[5] !== {smooth}.y[5]")
            before = page.evaluate(f"{smooth}.x.length")
            wait_until(page, f"{smooth}.x.length > {before}", timeout=10_000)  # still live
            page.select_option("#x-axis", "wall")
            assert page.evaluate("document.getElementById('chart-tps').layout.xaxis.type") == (
                "date")
            page.select_option("#x-axis", "relative")
            xs = page.evaluate(f"{smooth}.x")
            assert xs[0] == 0 and xs[-1] > 0  # minutes since the first step
            page.check("#log-y")
            assert page.evaluate("document.getElementById('chart-gradnorm').layout.yaxis.type") \
                == "log"
            page.screenshot(path=str(output_dir / "overview-tools.png"), full_page=True)
            # Zoom one chart: the others follow.
            page.select_option("#x-axis", "step")
            page.evaluate("Plotly.relayout(document.getElementById('chart-loss'), "
                          "{'xaxis.range': [50, 150]})")
            wait_until(page, "(document.getElementById('chart-tps').layout.xaxis.range || [])"
                             "[0] === 50", timeout=5_000)
            assert page.evaluate(
                "document.getElementById('chart-gradnorm').layout.xaxis.range") == [50, 150]
            # Back to plain lines: streaming extends them again, one trace per figure.
            page.fill("#smoothing", "0")
            page.dispatch_event("#smoothing", "input")
            n = page.evaluate(LOSS_POINTS)
            wait_until(page, f"{LOSS_POINTS} > {n}", timeout=10_000)
            assert page.evaluate(names) == ["train loss", "val loss"]
        finally:
            publisher.cancel()
    assert errors == []


def test_overview_shows_the_precision_switch_timeline(
    browser: Any, service: Any, live_server: Any, make_step: Any, tmp_path: Path
) -> None:
    for step in range(1, 65):
        service.hub.publish(make_step(RUN, step))
        if step == 32:
            service.hub.publish(_switch(RUN, 32, "block.0", "fp32", "bf16"))
        if step % 16 == 0:
            service.hub.publish(_window(RUN, step, ["bf16" if step >= 32 else "fp32", "fp32",
                                                    "fp32"]))
    with live_server(create_app(service)) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 1300})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        watch_csp(page, errors)
        try:
            browser_log_in(page, server.url, service.token)
            page.goto(server.url + "/")
            wait_until(page, f"({TIMELINE} ?? []).length === 2", timeout=20_000)
            assert page.is_visible("#chart-precision")
            spans = page.evaluate(f"{TIMELINE}.map((t) => [t.name, t.y, t.base, t.x])")
            # block.0: fp32 for steps 0-32, then bf16 to the newest step; the others fp32
            assert spans == [
                ["fp32", ["block.0", "block.1", "head"], [0, 0, 0], [32, 64, 64]],
                ["bf16", ["block.0"], [32], [32]],
            ]
            snr = page.evaluate("document.getElementById('chart-snr').data"
                                ".map((t) => [t.name, t.x, t.y])")
            assert snr[0] == ["block.0", [16, 32, 48, 64], [4, 8, 12, 16]]
            assert snr[2] == ["head", [16, 32, 48, 64], [None] * 4]

            # Live: block.1 drops at step 80 and head at 96; the bars follow.
            def publish(message: dict[str, Any]) -> None:
                server.loop.call_soon_threadsafe(service.hub.publish, message)

            for step in range(65, 97):
                publish(make_step(RUN, step))
            publish(_switch(RUN, 80, "block.1", "fp32", "bf16"))
            publish(_switch(RUN, 96, "head", "fp32", "bf16"))
            publish(_window(RUN, 96, ["bf16", "bf16", "bf16"]))
            wait_until(page, f"{TIMELINE}[1].y.length === 3", timeout=10_000)
            assert page.evaluate(f"{TIMELINE}[1].base") == [32, 80, 96]
            assert page.evaluate(f"{TIMELINE}[0].x") == [32, 80, 96]
            page.wait_for_timeout(400)
            shot = tmp_path / "precision.png"
            page.locator("#precision").screenshot(path=str(shot))
            save_artifact(shot, "precision.png")

            # Another run's messages leave this run's timeline alone; that run's own page,
            # without adaptive precision, has the section hidden.
            service.run_views.insert(0, replace(service.run_views[0], id=RUN + 1, name="next"))
            publish(make_step(RUN + 1, 1))
            page.wait_for_timeout(500)
            assert page.is_visible("#chart-precision")
            page.goto(f"{server.url}/?run={RUN + 1}")
            wait_until(page, f"{LOSS_POINTS} === 1", timeout=10_000)
            assert page.evaluate("document.getElementById('precision').hidden")
        finally:
            page.close()
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
        watch_csp(page, errors)  # a script or style the CSP blocked is an error too
        try:
            page.goto(server.url + "/hardware")
            assert page.locator(".gpu-card").count() == 2
            assert "SW power cap" in (page.text_content("#gpu-1 .throttles") or "")
            page.screenshot(path=str(output_dir / "hardware.png"), full_page=True)

            page.goto(server.url + "/comm")
            chart_traces = "document.getElementById('chart-busbw').data?.length ?? 0"
            wait_until(page, f"{chart_traces} === 2", timeout=10_000)
            # Mark the chart's node: the refresh must keep it (zoom and all), not redraw anew.
            page.evaluate("document.getElementById('chart-busbw').dataset.marked = 'yes'")
            page.screenshot(path=str(output_dir / "comm.png"), full_page=True)

            # New numbers from the service show up without a reload (refresh.js, every 5 s).
            service.metric_samples = [
                replace(s, value=99_000) if s.name == "traind_comm_buckets_total" else s
                for s in service.metric_samples
            ]
            wait_until(page,
                "document.getElementById('comm-table').textContent.includes('99,000')",
                timeout=12_000,
            )
            assert page.evaluate("document.getElementById('chart-busbw').dataset.marked") == "yes"
            assert page.evaluate(chart_traces) == 2
            assert page.text_content("#conn") == "live"
        finally:
            page.close()
    assert errors == []


def test_autotune_form_to_the_results_page(
    browser: Any, service: Any, live_server: Any, make_autotune: Any, make_promotions: Any,
    make_trials: Any, output_dir: Path,
) -> None:
    service.trials = make_trials()
    with live_server(create_app(service)) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        watch_csp(page, errors)  # a script or style the CSP blocked is an error too
        try:
            browser_log_in(page, server.url, service.token)
            page.goto(server.url + "/experiments")
            form = page.locator("#autotune-form")
            # The queue's buttons post the new order and come back to the page.
            page.click("#trial-23 button[value=up]")
            page.wait_for_url("**/experiments#queue")
            assert [t.id for t in service.trials] == [21, 23, 22]
            form.locator("input[name=name]").fill("tune-from-the-browser")
            form.locator("input[name=precision][value=fp8]").check()
            form.locator("input[name=method][value=powersgd]").check()
            form.locator("input[name=steps]").fill("120")
            form.locator("select[name=target_run]").select_option("3")
            page.screenshot(path=str(output_dir / "experiments.png"), full_page=True)
            form.locator("button[type=submit]").click()
            page.wait_for_url("**/autotunes/1")
            spec = service.tune_specs[0]
            assert spec.precisions == ("fp32", "bf16", "fp8") and spec.steps == 120
            assert {"method": "powersgd"} in spec.compressions and spec.target_run_id == 3
            assert page.text_content("#autotune .badge") == "running"
            assert "fp8.none" in (page.text_content("#infeasible") or "")

            # The search ends: the page reloads itself (every 5 s while running) and shows it.
            service.promotion_views = make_promotions(3)
            service.autotune_infos[1] = make_autotune(1)
            wait_until(page,
                "document.querySelector('#autotune .badge').textContent === 'done'",
                timeout=12_000)
            assert page.locator("#rounds tbody.round").count() == 4
            assert "1.183\u00d7" in (page.text_content("#rounds") or "")
            assert page.locator("#promotions tbody tr").count() == 2
            page.screenshot(path=str(output_dir / "autotune.png"), full_page=True)
        finally:
            page.close()
    assert errors == []
