"""A run's page in a real Chromium: stored series of 100,000 steps drawn with their envelope,
the chart tools, linked zoom, the confirmed stop, and a phone-width look."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import browser_log_in, wait_until, watched_page
from tests.web.conftest import synthetic_columns
from traind.web.app import create_app

if TYPE_CHECKING:
    from pathlib import Path

LOSS = "document.getElementById('chart-loss')"
LONG = 100_000


def transferred(page: Any, *, cold: bool = False) -> int:
    """Bytes the page's document and resources took over the wire; ``cold``: as a browser
    with an empty cache would fetch them (their encoded sizes, gzip included)."""
    size = "e.encodedBodySize" if cold else "e.transferSize"
    return int(page.evaluate(
        "[...performance.getEntriesByType('navigation'), "
        "...performance.getEntriesByType('resource')]"
        f".reduce((n, e) => n + ({size} || 0), 0)"))


def test_a_long_runs_page_draws_its_stored_steps_and_the_tools_work(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    service.step_columns[3] = synthetic_columns(service.run_views[0], steps=LONG)
    service.switches[3] = [{"step": 30_000, "group": "block.0", "before": "fp32",
                            "after": "bf16", "snr": 5.0}]
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        browser_log_in(page, server.url, service.token)
        t0 = time.monotonic()
        page.goto(server.url + "/runs/3")
        wait_until(page, "document.getElementById('run').dataset.points === '100000'",
                   timeout=20_000)
        loaded = time.monotonic() - t0
        traces = page.evaluate(f"{LOSS}.data.map((t) => t.name)")
        assert traces == ["train loss max", "train loss min", "train loss", "val loss"]
        assert page.evaluate(f"{LOSS}.data[2].x.length") == 2000
        # The envelope holds step 700's spike (7+) that the bucket mean averages away.
        assert page.evaluate(f"Math.max(...{LOSS}.data[0].y)") > 7.5
        assert page.evaluate(f"Math.max(...{LOSS}.data[2].y)") < 7.5
        assert "100,000 steps stored, each point the mean of 50 steps" in page.text_content(
            "#series-note")
        assert not page.is_hidden("#layers-card") and not page.is_hidden("#precision-card")
        assert page.text_content("[data-field=step]") == "100,000"
        page.screenshot(path=str(output_dir / "run-page.png"), full_page=True)
        cold = transferred(page, cold=True)
        page.reload()  # warm: plotly and the stylesheet come from the browser's cache
        wait_until(page, "document.getElementById('run').dataset.points === '100000'",
                   timeout=20_000)
        warm = transferred(page)
        static = page.evaluate("performance.getEntriesByType('resource')"
                               ".filter((e) => e.name.includes('/static/'))"
                               ".map((e) => e.transferSize)")
        # Warm, every asset comes from the cache (at most a 304's headers to revalidate).
        assert static and max(static) < 1000, static
        assert warm < cold / 3, (cold, warm)
        (output_dir / "run-page-load.txt").write_text(
            f"run page, {LONG:,} stored steps: drawn {loaded:.2f} s after goto; "
            f"{cold / 1e3:,.0f} kB over the wire cold, {warm / 1e3:,.0f} kB warm\n")

        # Smoothing keeps the raw line, faint, under the smoothed one.
        page.fill("#smoothing", "0.9")
        page.dispatch_event("#smoothing", "input")
        names = page.evaluate(f"{LOSS}.data.map((t) => t.name)")
        assert "train loss (raw)" in names
        raw = page.evaluate(f"{LOSS}.data.find((t) => t.name === 'train loss (raw)').y")
        smooth = page.evaluate(f"{LOSS}.data.find((t) => t.name === 'train loss').y")
        assert raw != smooth and raw[0] == smooth[0]  # debiased: starts where the data does
        # The x axis by wall time, log y.
        page.select_option("#x-axis", "wall")
        assert page.evaluate(f"{LOSS}.layout.xaxis.type") == "date"
        page.check("#log-y")
        assert page.evaluate(f"{LOSS}.layout.yaxis.type") == "log"
        page.select_option("#x-axis", "step")
        # Zoom one chart: the others follow.
        page.evaluate(f"Plotly.relayout({LOSS}, {{'xaxis.range': [1000, 2000]}})")
        wait_until(page, "(document.getElementById('chart-tps').layout.xaxis.range || [])[0]"
                         " === 1000", timeout=5_000)
        assert page.evaluate("document.getElementById('chart-lr').layout.xaxis.range") == [
            1000, 2000]

        # Stop asks first: dismissed, nothing is stopped; accepted, the run is asked to.
        page.once("dialog", lambda d: d.dismiss())
        page.click("#stop-form button")
        page.wait_for_timeout(300)
        assert service.stopped == []
        page.once("dialog", lambda d: d.accept())
        with page.expect_navigation():
            page.click("#stop-form button")
        assert service.stopped == [3]
    assert errors == []
    print(f"run page with {LONG:,} stored steps drawn in {loaded:.2f} s")


def test_sorting_and_filtering_200_runs_in_the_browser(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    from tests.web.test_runs import filterable, many_runs, row_ids

    service.run_views = many_runs()
    experiment = filterable(service)  # its trials ran as runs 20..31
    loss = {r.id: r.summary["loss"] for r in service.run_views}
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        page.goto(server.url + "/runs")
        with page.expect_navigation():
            page.click("th a.sort >> text=Loss")  # largest first
        ids = row_ids(page.content())
        assert [loss[i] for i in ids] == sorted((loss[i] for i in ids), reverse=True)
        assert max(loss.values()) == loss[ids[0]]
        page.select_option("#run-filters select[name=state]", "running")
        page.fill("#run-filters input[name=name]", "SWEEP")
        with page.expect_navigation():
            page.click("#run-filters button")
        assert "state=running" in page.url and "sort=loss" in page.url  # order kept
        shown = row_ids(page.content())
        assert shown and all(service.run_views[200 - i].state == "running" for i in shown)
        page.screenshot(path=str(output_dir / "runs-sorted-filtered.png"), full_page=True)
        with page.expect_navigation():
            page.click(f"#run-{shown[0]} td.name a")
        assert page.url.endswith(f"/runs/{shown[0]}")

        # From an experiment's page to its runs in the table, then narrowed by a config key.
        page.goto(server.url + f"/experiments/{experiment}")
        with page.expect_navigation():
            page.click("#runs-table-link")
        assert sorted(row_ids(page.content())) == list(range(20, 32))
        assert page.input_value("#run-filters input[name=experiment]") == str(experiment)
        with page.expect_navigation():
            page.click("th a.sort >> text=Loss")
        page.fill("#run-filters input[name=config]", "precision..mode=bf16")  # not a key
        page.click("#run-filters button")
        assert page.evaluate("document.querySelector('#run-filters input[name=config]')"
                             ".validity.patternMismatch")
        assert "config=" not in page.url  # the browser refused to send it
        page.fill("#run-filters input[name=config]", "compression.method=powersgd")
        with page.expect_navigation():
            page.click("#run-filters button")
        assert "experiment=7" in page.url and "sort=loss" in page.url
        shown = row_ids(page.content())
        assert sorted(shown) == [21, 25, 29]
        assert [loss[i] for i in shown] == sorted((loss[i] for i in shown), reverse=True)
        page.screenshot(path=str(output_dir / "runs-experiment-config.png"), full_page=True)
        with page.expect_navigation():
            page.click("th a.sort >> text=ID")  # the filters ride in the headings' links
        assert row_ids(page.content()) == [29, 25, 21]
        with page.expect_navigation():
            page.click("#run-filters a >> text=clear")
        assert len(row_ids(page.content())) == 50
    assert errors == []


def test_the_pages_fit_a_phone(browser: Any, service: Any, live_server: Any,
                                   output_dir: Path) -> None:
    with (live_server(create_app(service)) as server,
          watched_page(browser, 390, 844) as (page, errors)):
        page.goto(server.url + "/runs/1")
        wait_until(page, "document.getElementById('run').dataset.points === '5000'",
                   timeout=20_000)
        page.screenshot(path=str(output_dir / "run-page-phone.png"), full_page=True)
        widths = {"/runs/1": page.evaluate("document.documentElement.scrollWidth")}
        for path in ("/", "/runs", "/experiments", "/hardware", "/comm"):
            page.goto(server.url + path)
            widths[path] = page.evaluate("document.documentElement.scrollWidth")
    assert errors == []
    wide = {p: w for p, w in widths.items() if w > 390}
    assert not wide, f"pages that scroll sideways on a phone (px wide): {wide}"


def test_the_api_docs_work_with_the_network_blocked(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        outside: list[str] = []

        def only_the_daemon(route: Any) -> None:
            if route.request.url.startswith(server.url):
                route.continue_()
            else:  # an air-gapped node: nothing beyond the daemon answers
                outside.append(route.request.url)
                route.abort()

        page.route("**/*", only_the_daemon)
        page.goto(server.url + "/api/docs")
        wait_until(page, "document.querySelectorAll('.swagger-ui .opblock').length > 10",
                   timeout=20_000)
        assert "/api/runs/{run_id}/series" in page.text_content(".swagger-ui")
        page.screenshot(path=str(output_dir / "api-docs-offline.png"))
        page.goto(server.url + "/api/redoc")
        wait_until(page, "document.body.innerText.includes('/api/runs/{run_id}/series')",
                   timeout=20_000)
        page.screenshot(path=str(output_dir / "api-redoc-offline.png"))
    # ReDoc's sidebar asks for its "powered by" logo from its CDN; the CSP refuses it before
    # it leaves the page (nothing else is fetched from outside).
    errors = [e for e in errors if "cdn.redoc.ly/redoc/logo-mini.svg" not in e]
    assert outside == [] and errors == []


def test_two_runs_overlaid_from_the_runs_table(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    service.configs = {1: {"job": {"name": "baseline"}, "precision": {"mode": "fp32"}},
                       3: {"job": {"name": "gpt"}, "precision": {"mode": "bf16"}}}
    service.step_columns[1] = synthetic_columns(service.run_views[2], steps=3000)
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        page.goto(server.url + "/runs")
        page.check('input[name=ids][value="3"]')
        page.check('input[name=ids][value="1"]')
        with page.expect_navigation():
            page.click("#compare-form button")
        assert "/runs/compare?ids=3&ids=1" in page.url
        wait_until(page, "document.getElementById('run').dataset.points === '1200,3000'",
                   timeout=20_000)
        names = page.evaluate(f"{LOSS}.data.map((t) => t.name)")
        assert names == ['#3 gpt-small-bf16 · precision.mode="bf16"',
                         '#3 gpt-small-bf16 · precision.mode="bf16" val',
                         '#1 baseline · precision.mode="fp32"',
                         '#1 baseline · precision.mode="fp32" val']
        colors = page.evaluate(f"{LOSS}.data.map((t) => t.line?.color ?? t.marker?.color)")
        assert colors[0] != colors[2]  # a colour each
        assert page.evaluate("document.getElementById('chart-tps').data.length") == 2
        assert "precision.mode" in page.text_content("#config-differences")
        page.screenshot(path=str(output_dir / "runs-compared.png"), full_page=True)
    assert errors == []


def test_a_two_rank_runs_page_draws_a_line_per_rank(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    from tests.web.test_runs import two_ranks

    two_ranks(service)  # run 1: 5,000 steps on 2 ranks, rank 1 the straggler
    step = "document.getElementById('chart-step')"
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        page.goto(server.url + "/runs/1")
        wait_until(page, "document.getElementById('run').dataset.points === '5000'",
                   timeout=20_000)
        job = ["step max", "step min", "step", "data wait"]  # the lead's, with its band
        assert page.evaluate(f"{step}.data.map((t) => t.name)") == job
        # The ranks' medians, the straggler's phases marked.
        wait_until(page, "!document.getElementById('ranks-card').hidden", timeout=5_000)
        assert page.eval_on_selector_all("#rank-1 td.straggler", "els => els.length") == 2
        assert page.eval_on_selector_all("#rank-0 td.straggler", "els => els.length") == 1
        page.check("#per-rank")
        names = page.evaluate(f"{step}.data.map((t) => t.name)")
        assert names == ["rank 0 step", "rank 0 data wait", "rank 1 step", "rank 1 data wait"]
        lines = page.evaluate(f"{step}.data.filter((t) => t.name.endsWith(' step'))"
                              ".map((t) => [t.x.length, t.line.color, "
                              "t.y.reduce((a, b) => a + b, 0) / t.y.length])")
        assert [n for n, _, _ in lines] == [2000, 2000]  # two lines drawn, each downsampled
        assert lines[0][1] != lines[1][1]  # a colour each
        assert lines[1][2] > lines[0][2] * 1.15  # the straggler stands apart
        tps = page.evaluate("document.getElementById('chart-tps').data.map((t) => t.name)")
        assert tps == ["rank 0 tokens/s", "rank 1 tokens/s"]
        assert page.evaluate("document.getElementById('chart-loss').data.length") == 3  # + val
        page.screenshot(path=str(output_dir / "run-page-ranks.png"), full_page=True)
        page.uncheck("#per-rank")
        assert page.evaluate(f"{step}.data.map((t) => t.name)") == job
    assert errors == []


def _series_fetches(page: Any) -> list[tuple[str, int]]:
    return page.evaluate(
        "performance.getEntriesByType('resource').filter((e) => e.name.includes('/series?'))"
        ".map((e) => [e.name, e.transferSize])")


def test_a_growing_runs_page_appends_new_steps_and_draws_its_communication(
    browser: Any, service: Any, live_server: Any, output_dir: Path
) -> None:
    from dataclasses import replace

    from tests.web.conftest import synthetic_comm_chunks

    run = replace(service.run_views[0], summary={**service.run_views[0].summary,
                                                 "world_size": 2})  # run 3, running
    service.run_views = [run, *service.run_views[1:]]
    n = LONG
    service.step_columns[3] = synthetic_columns(run, steps=n)
    service.comm_chunks[3] = synthetic_comm_chunks(service.step_columns[3]["step"])

    def grow(by: int) -> None:  # whole new objects: the server thread reads them meanwhile
        nonlocal n
        service.comm_chunks[3] = [*service.comm_chunks[3],
                                  *synthetic_comm_chunks(range(n + 1, n + by + 1))]
        n += by
        service.step_columns[3] = synthetic_columns(run, steps=n)

    points = "document.getElementById('run').dataset.points"
    loss = f"{LOSS}.data.find((t) => t.name === 'train loss')"
    lat = "document.getElementById('chart-comm-latency')"
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1440, 900) as (page, errors)):
        page.add_init_script("window.traindRefreshMs = 400")
        page.goto(server.url + "/runs/3")
        wait_until(page, f"{points} === '100000'", timeout=30_000)
        # The Communication section: latency percentiles, bus bandwidth, bytes raw and sent.
        wait_until(page, "!document.getElementById('comm-charts').hidden", timeout=5_000)
        names = page.evaluate(f"{lat}.data.map((t) => t.name)")
        assert names == [f"{op} {q}" for op in ("all_gather", "all_reduce")
                         for q in ("p50", "p95", "p99")]
        assert page.evaluate(f"{lat}.data[3].x.length") == 2000  # 10,000 reports downsampled
        bw = page.evaluate("document.getElementById('chart-comm-busbw').data"
                           ".map((t) => [t.name, Math.min(...t.y)])")
        assert [b[0] for b in bw] == ["all_gather", "all_reduce"] and all(b[1] > 0 for b in bw)
        sent = page.evaluate("document.getElementById('chart-comm-bytes').data"
                             ".map((t) => t.y[0])")
        assert sent[0] == pytest.approx(16 * sent[1])  # raw vs sent: PowerSGD's ~16x
        page.screenshot(path=str(output_dir / "run-page-comm.png"), full_page=True)
        whole = [f for f in _series_fetches(page) if "after=" not in f[0]]
        assert len(whole) == 1

        for _ in range(3):  # the run trains on: 50 steps (5 comm reports) a poll or so
            before = page.evaluate(f"Number({points})")
            grow(50)
            wait_until(page, f"{points} === '{n}'", timeout=10_000)
            assert before < n
        assert page.evaluate(f"{loss}.x.length") == 2000 + 150  # appended, not redrawn
        assert page.evaluate(f"{loss}.x[{loss}.x.length - 1]") == n
        assert page.evaluate(f"{lat}.data[3].x[{lat}.data[3].x.length - 1]") == n
        fetches = _series_fetches(page)
        tails = [size for name, size in fetches if "after=" in name]
        assert len(fetches) - len(tails) == 1, fetches  # no whole fetch while it grew
        wait_until(page, "Number(document.getElementById('run').dataset.polls) >= 4",
                   timeout=5_000)

        grow(2500)  # past the points budget: the whole series again, downsampled
        wait_until(page, f"{points} === '{n}'", timeout=20_000)
        assert page.evaluate(f"{loss}.x.length") == 2000
        assert sum("after=" not in name for name, _ in _series_fetches(page)) == 2
    assert errors == []
    full = whole[0][1]
    grown = [s for s in tails if s > 2000] or tails
    (output_dir / "run-page-polls.txt").write_text(
        f"a 2-rank run of {LONG:,} stored steps (ranks and comm asked), bytes per poll: "
        f"whole series {full / 1e3:,.1f} kB (every poll before); a tail "
        f"{min(tails) / 1e3:,.1f} kB with nothing new, up to {max(grown) / 1e3:,.1f} kB "
        f"with 50 new steps ({len(tails)} tails)\n")
    print((output_dir / "run-page-polls.txt").read_text())
