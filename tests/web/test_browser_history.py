"""Communication and Hardware over time in a real Chromium: the charts carry the daemon's
buffered history, a page says which setting a missing chart needs or that no GPU is seen,
dark mode reaches the charts, and a phone needs no sideways scroll."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tests.conftest import wait_until, watched_page
from traind.web.app import create_app

if TYPE_CHECKING:
    from pathlib import Path


def traces(page: Any, key: str) -> int:
    return int(page.evaluate(f"document.getElementById('chart-{key}')?.data?.length ?? 0"))


def points(page: Any, key: str) -> int:
    """Points with a value in the chart's first trace."""
    return int(page.evaluate(
        f"(document.getElementById('chart-{key}')?.data?.[0]?.y ?? [])"
        ".filter((v) => v !== null).length"))


def test_comm_and_hardware_draw_their_history(browser: Any, service: Any, live_server: Any,
                                              output_dir: Path) -> None:
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1280, 900) as (page, errors)):
        page.goto(server.url + "/comm")
        wait_until(page, "document.getElementById('chart-latency-all_reduce')?.data?.length "
                   "=== 3", timeout=10_000)
        names = page.evaluate(
            "document.getElementById('chart-latency-all_reduce').data.map((t) => t.name)")
        assert names == ["p50", "p95", "p99"]
        assert points(page, "latency-all_reduce") == 360  # half an hour of 5 s slots
        assert page.evaluate("document.getElementById('chart-latency-all_reduce')"
                             ".layout.xaxis.type") == "date"
        assert traces(page, "latency-all_gather") == 3
        assert traces(page, "probe-busbw") == 8  # one line per probe message size
        assert points(page, "probe-busbw") == 30  # a probe a minute
        assert page.locator("#probe-off").count() == 0
        page.screenshot(path=str(output_dir / "comm-over-time.png"), full_page=True)

        page.goto(server.url + "/hardware")
        wait_until(page, "document.getElementById('chart-gpu-nvlink')?.data?.length === 4",
                   timeout=10_000)
        for key, n in (("cpu", 1), ("memory", 1), ("gpu-util", 2), ("gpu-power", 2),
                       ("gpu-pcie", 4)):
            assert traces(page, key) == n, key
            assert points(page, key) >= 359, key  # NVLink's first sample has no rate yet
        assert page.locator("#gpu-absent").count() == 0
        page.screenshot(path=str(output_dir / "hardware-over-time.png"), full_page=True)

        # The 5 s refresh keeps the chart (and a user's zoom) and gives it the new sample.
        page.evaluate("document.getElementById('chart-cpu').dataset.marked = 'yes'")
        service.hardware.record({"cpu": 0.01, "memory_used": 1.0, "memory_total": 2.0,
                                 "gpu_devices": 2, "gpus": {}})
        wait_until(page, "document.getElementById('chart-cpu').data[0].y.length === 361",
                   timeout=12_000)
        assert page.evaluate("document.getElementById('chart-cpu').dataset.marked") == "yes"
    assert errors == []


def test_a_node_without_gpu_or_probe_says_so_and_draws_the_host(
        browser: Any, fake_service: Any, canned: Any, live_server: Any,
        output_dir: Path) -> None:
    service = fake_service(metric_samples=[*canned["host"](), *canned["comm"]()])
    canned["comm_history"](service.comm, probe=False)
    canned["hardware_history"](service.hardware, gpus=0)
    with (live_server(create_app(service)) as server,
          watched_page(browser, 1280, 900) as (page, errors)):
        page.goto(server.url + "/hardware")
        wait_until(page, "document.getElementById('chart-cpu')?.data?.length === 1",
                   timeout=10_000)
        assert points(page, "cpu") == 360 and points(page, "memory") == 360
        assert traces(page, "gpu-util") == 0
        said = page.text_content("#gpu-absent") or ""
        assert "No GPU seen (NVML: NVML Shared Library Not Found)" in said, said
        page.screenshot(path=str(output_dir / "hardware-over-time-no-gpu.png"), full_page=True)

        page.goto(server.url + "/comm")
        wait_until(page, "document.getElementById('chart-latency-all_reduce')?.data?.length "
                   "=== 3", timeout=10_000)
        assert traces(page, "probe-busbw") == 0
        notice = " ".join((page.text_content("#probe-off") or "").split())
        for part in ("off by default", "telemetry.probe_every", "[telemetry] probe_every = 100",
                     "traind serve --set telemetry.probe_every=100",
                     "TRAIND_TELEMETRY__PROBE_EVERY=100"):
            assert part in notice, (part, notice)
        page.screenshot(path=str(output_dir / "comm-over-time-no-probe.png"), full_page=True)
    assert errors == []


def test_history_charts_follow_dark_mode_and_fit_a_phone(
        browser: Any, service: Any, live_server: Any, output_dir: Path) -> None:
    with (live_server(create_app(service)) as server,
          watched_page(browser, 390, 844) as (page, errors)):
        page.emulate_media(color_scheme="dark")
        widths = {}
        for path, chart in (("/comm", "latency-all_reduce"), ("/hardware", "gpu-nvlink")):
            page.goto(server.url + path)
            wait_until(page, f"document.getElementById('chart-{chart}')?.data?.length > 0",
                       timeout=10_000)
            bg = page.evaluate("getComputedStyle(document.documentElement)"
                               ".getPropertyValue('--chart-bg').trim()")
            assert page.evaluate(f"document.getElementById('chart-{chart}')"
                                 ".layout.paper_bgcolor") == bg != "#ffffff"
            if path == "/comm":  # the probe's chart by message size has the same look
                assert page.evaluate("document.getElementById('chart-busbw')"
                                     ".layout.paper_bgcolor") == bg
            widths[path] = page.evaluate("document.documentElement.scrollWidth")
            name = path.strip("/")
            page.screenshot(path=str(output_dir / f"{name}-over-time-phone-dark.png"),
                            full_page=True)
    assert errors == []
    wide = {p: w for p, w in widths.items() if w > 390}
    assert not wide, f"pages that scroll sideways on a phone (px wide): {wide}"
