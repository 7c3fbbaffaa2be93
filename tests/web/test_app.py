"""The app against a fake NodeService with a real EventHub, through Starlette's TestClient."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from tests.web.conftest import log_in
from traind.daemon.ingest.hardware_history import HardwareHistory
from traind.daemon.service import MetricSample, RunView
from traind.web.app import create_app as _create_app
from traind.web.hosts import same_origin

if TYPE_CHECKING:
    from collections.abc import Iterator

# TestClient sends Host: testserver; the app answers loopback names only unless told.
create_app = partial(_create_app, allowed_hosts=["testserver"])


@pytest.fixture
def client(service: Any) -> Iterator[TestClient]:
    # Entering the client starts its portal (an event loop in a thread) and keeps it: the
    # websocket sessions run on it, and tests publish to the hub on it via client.portal.call.
    with TestClient(create_app(service, title="traind-test")) as c:
        log_in(c)  # a browser session: what the forms and the live feed need
        yield c


def publish(client: TestClient, service: Any, message: dict[str, Any]) -> None:
    """EventHub.publish must run on the loop that owns the subscribers' queues."""
    assert client.portal is not None
    client.portal.call(service.hub.publish, message)


def test_overview_page_has_the_charts_and_the_current_run(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    for chart in ("chart-loss", "chart-tps", "chart-gradnorm"):
        assert f'id="{chart}"' in r.text
    # No live points yet, so the header follows the running run.
    assert "gpt-small-bf16" in r.text and 'data-run="3"' in r.text
    assert "/static/vendor/plotly.min.js?v=" in r.text
    assert "traind-test" in r.text
    for href in ('href="/"', 'href="/runs"', 'href="/hardware"', 'href="/comm"', 'href="/metrics"'):
        assert href in r.text


def test_overview_stays_on_the_training_run_and_shows_the_one_chosen(
    client: TestClient, service: Any, make_step: Any
) -> None:
    publish(client, service, make_step(1, 10))  # another run's live points do not move it
    assert 'data-run="3"' in client.get("/").text
    page = client.get("/?run=1").text
    assert 'data-run="1"' in page
    # one run training: nothing to pick between... but the one shown is not it: both offered
    assert 'id="run-picker"' in page and '<option value="3"' in page
    assert 'id="run-picker"' not in client.get("/").text
    assert 'data-run="3"' in client.get("/?run=999").text  # not a run: the usual choice
    assert client.get("/?run=x").status_code == 422
    assert client.get("/api/live?run=1").json()["steps"][0]["step"] == 10
    assert client.get("/api/live?run=3").json() == {
        "type": "snapshot", "run": 3, "steps": [], "evals": [], "precision": [], "snr": []}


def test_overview_without_runs(fake_service: Any) -> None:
    with TestClient(create_app(fake_service())) as c:
        r = c.get("/")
    assert r.status_code == 200 and "No runs yet" in r.text


def test_runs_page_lists_runs_with_badges_and_errors(client: TestClient) -> None:
    r = client.get("/runs")
    assert r.status_code == 200
    text = r.text
    for name in ("gpt-small-bf16", "gpt-small-fp8", "baseline"):
        assert name in text
    for state in ("running", "failed", "completed"):
        assert f'class="badge badge-{state}"' in text
    # Only the failed run gets a <details> with its log, escaped.
    assert text.count("<details>") == 1
    assert "RuntimeError: &lt;boom&gt;" in text
    assert "51,234" in text  # tokens/s
    assert "3.2100" in text  # loss
    assert "4h 00m" in text  # run 1: started a day before T0, finished 20h before T0


def test_runs_page_and_overview_warn_of_oversubscribed_cpus(fake_service: Any) -> None:
    now = datetime.now(UTC)
    crowded = RunView(id=5, name="crowded", state="running", created_at=now, started_at=now,
                      finished_at=None, exit_code=None, error=None,
                      summary={"step": 10, "ranks_per_node": 2, "threads": 2, "usable_cpus": 2,
                               "host_checks": 8, "host_oversubscribed": 7})
    quiet = replace(crowded, id=4, name="quiet", state="completed", summary={
        "step": 10, "ranks_per_node": 2, "threads": 1, "usable_cpus": 2, "host_checks": 8})
    with TestClient(create_app(fake_service(run_views=[crowded, quiet]))) as c:
        runs, overview = c.get("/runs").text, c.get("/").text
    # the crowded run's body has both warnings; the quiet one's none
    body = runs.split('id="run-5"')[1].split("</tbody>")[0]
    assert body.count('class="ab-row cpu-warning"') == 2
    assert "2 ranks \u00d7 2 threads on 2 usable CPUs" in body
    assert "in 7 of 8 checks while this run trained" in body
    assert "cpu-warning" not in runs.split('id="run-4"')[1]
    assert overview.count('class="notice notice-warn cpu-warning"') == 2


def test_api_runs(client: TestClient, service: Any) -> None:
    runs = service.runs()
    r = client.get("/api/runs")
    assert r.status_code == 200
    body = r.json()
    assert [run["id"] for run in body] == [3, 2, 1]
    assert body[0]["state"] == "running"
    started = datetime.fromisoformat(body[0]["started_at"])
    assert started.utcoffset() == timedelta(0) and started == runs[0].started_at
    assert body[0]["finished_at"] is None
    assert body[1]["exit_code"] == 1 and "boom" in body[1]["error"]
    assert body[2]["summary"]["val_loss"] == 3.0


def test_api_live_snapshot(client: TestClient, service: Any, make_step: Any) -> None:
    assert client.get("/api/live").json() == {
        "type": "snapshot",
        "run": None,
        "steps": [],
        "evals": [],
        "precision": [],
        "snr": [],
    }
    publish(client, service, make_step(4, 1))
    snap = client.get("/api/live").json()
    assert snap["run"] == 4 and [s["step"] for s in snap["steps"]] == [1]


@pytest.mark.parametrize(("healthy", "code"), [(True, 200), (False, 503)])
def test_healthz(fake_service: Any, healthy: bool, code: int) -> None:
    with TestClient(create_app(fake_service(healthy=healthy))) as c:
        r = c.get("/healthz")
    assert r.status_code == code
    assert r.json()["ok"] is healthy


def test_metrics_passes_accept_and_content_type_through(client: TestClient, service: Any) -> None:
    r = client.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "traind_up 1" in r.text
    assert service.accepts == ["application/openmetrics-text"]


def test_plotly_is_served_from_the_plotly_package(client: TestClient) -> None:
    r = client.get("/static/vendor/plotly.min.js")
    assert r.status_code == 200
    assert "javascript" in r.headers["content-type"]
    assert "max-age=31536000" in r.headers["cache-control"]
    assert len(r.content) > 1_000_000 and b"plotly" in r.content[:2000].lower()


def test_own_static_files(client: TestClient) -> None:
    for path, kind in (("/static/app.js", "javascript"), ("/static/style.css", "text/css")):
        r = client.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"] and r.content


def test_websocket_sends_snapshot_then_live_messages(
    client: TestClient, service: Any, make_step: Any, make_eval: Any
) -> None:
    publish(client, service, make_step(7, 1))
    with client.websocket_connect(live_path(client)) as ws:
        snap = ws.receive_json()
        assert snap["type"] == "snapshot" and snap["run"] == 7
        assert [s["step"] for s in snap["steps"]] == [1]
        # The handler subscribed before sending the snapshot, so this cannot be missed.
        publish(client, service, make_step(7, 2))
        publish(client, service, make_eval(7, 2))
        publish(client, service, {"type": "run", "run": 7, "state": "completed"})
        assert ws.receive_json() == make_step(7, 2)
        assert ws.receive_json() == make_eval(7, 2)
        assert ws.receive_json() == {"type": "run", "run": 7, "state": "completed"}
    # Closing the socket ends the subscription without waiting for another publish.
    assert client.portal is not None
    for _ in range(100):
        if client.portal.call(lambda: service.hub.subscribers) == 0:
            break
        client.portal.call(_sleep, 0.01)
    assert service.hub.subscribers == 0


def live_path(client: TestClient) -> str:
    """/ws/live with the live token the pages rendered for the client's session carry."""
    return f"/ws/live?live={session_of(client).live}"


def session_of(client: TestClient) -> Any:
    from traind.web.sessions import COOKIE

    return client.app.state.sessions.get(client.cookies.get(COOKIE))  # type: ignore[attr-defined]


def test_the_pages_carry_the_sessions_live_token(client: TestClient) -> None:
    token = session_of(client).live
    assert f'<meta name="traind-live" content="{token}">' in client.get("/").text


def test_websocket_needs_a_credential(client: TestClient, service: Any) -> None:
    for path, headers in (("/ws/live", {}), ("/ws/live?live=wrong", {}),
                          ("/ws/live?token=wrong", {}),
                          ("/ws/live", {"authorization": "Bearer wrong"})):
        with (
            pytest.raises(WebSocketDisconnect) as exc,
            client.websocket_connect(path, headers=headers) as ws,
        ):
            ws.receive_json()
        assert exc.value.code == 1008, path
    # A program with the daemon's token, by header or query.
    token = service.token
    for path, headers in ((f"/ws/live?token={token}", {}),
                          ("/ws/live", {"authorization": f"Bearer {token}"})):
        with client.websocket_connect(path, headers=headers) as ws:
            assert ws.receive_json()["type"] == "snapshot"


async def _sleep(seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)


def test_websocket_accepts_same_origin(client: TestClient) -> None:
    with client.websocket_connect(live_path(client),
                                  headers={"origin": "http://testserver"}) as ws:
        assert ws.receive_json()["type"] == "snapshot"


def test_websocket_refuses_foreign_origin(client: TestClient) -> None:
    with (
        pytest.raises(WebSocketDisconnect) as exc,
        client.websocket_connect(live_path(client),
                                 headers={"origin": "http://evil.example"}) as ws,
    ):
        ws.receive_json()
    assert exc.value.code == 1008


@pytest.mark.parametrize(
    ("origin", "scheme", "host", "allowed"),
    [
        (None, "http", "127.0.0.1:8800", True),
        ("http://127.0.0.1:8800", "http", "127.0.0.1:8800", True),
        ("https://Node-1.example:443", "https", "node-1.example:443", True),
        ("https://node-1.example", "https", "node-1.example:443", True),  # default port
        ("http://localhost", "ws", "localhost:80", True),  # a websocket's page
        ("https://127.0.0.1:8800", "wss", "127.0.0.1:8800", True),
        ("http://[::1]:8800", "http", "[::1]:8800", True),
        ("https://127.0.0.1:8800", "http", "127.0.0.1:8800", False),  # the scheme counts
        ("http://127.0.0.1:8800", "https", "127.0.0.1:8800", False),
        ("http://127.0.0.1:8800", "wss", "127.0.0.1:8800", False),
        ("http://127.0.0.1", "http", "127.0.0.1:8800", False),  # so does the port
        ("http://127.0.0.1:9999", "http", "127.0.0.1:8800", False),
        ("http://localhost:8800", "http", "127.0.0.1:8800", False),
        ("null", "http", "127.0.0.1:8800", False),
        ("http://evil.example", "http", None, False),
        ("http://127.0.0.1:8800/x", "http", "127.0.0.1:8800", False),
    ],
)
def test_same_origin(origin: str | None, scheme: str, host: str | None, allowed: bool) -> None:
    assert same_origin(origin, scheme, host) is allowed


def test_api_runs_gives_naive_database_times_an_utc_offset(fake_service: Any, service: Any) -> None:
    naive = replace(service.runs()[0], started_at=datetime(2025, 1, 2, 3, 4, 5))
    with TestClient(create_app(fake_service(run_views=[naive]))) as c:
        started = c.get("/api/runs").json()[0]["started_at"]
    assert datetime.fromisoformat(started) == datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_nav_bar_links_every_page(client: TestClient) -> None:
    text = client.get("/runs").text
    links = ['href="/"', 'href="/runs"', 'href="/hardware"', 'href="/comm"', 'href="/metrics"']
    positions = [text.index(link) for link in links]
    assert positions == sorted(positions)  # Overview, Runs, Hardware, Communication, Metrics
    assert ">Hardware</a>" in text and ">Communication</a>" in text


def test_hardware_page_with_gpus(client: TestClient, service: Any) -> None:
    r = client.get("/hardware")
    assert r.status_code == 200
    text = r.text
    assert 'href="/hardware" aria-current="page"' in text
    assert "No NVIDIA GPU" not in text
    assert 'id="gpu-0"' in text and 'id="gpu-1"' in text and 'id="gpu-2"' not in text
    assert "NVIDIA H100 80GB HBM3" in text
    assert "61.4 GiB / 79.6 GiB" in text  # GPU memory
    assert "699 W / 700 W" in text  # GPU 1 at its power cap: warning bar
    assert text.count("bar bar-warn") >= 1
    assert "1,980 MHz" in text and "Gen 5 \u00d716" in text and "18 up" in text
    assert '<span class="badge badge-warn"' in text and "SW power cap" in text
    assert "GPU idle" not in text  # reasons at 0 are not shown
    assert "63%" in text and "18.42 \u00b7 17.90 \u00b7 12.05" in text  # host CPU and load
    assert "96.2 GiB / 251.5 GiB" in text
    assert "4188" in text and "9.8 GiB" in text  # a worker process
    assert "nvme0n1" in text and "eth0" in text
    assert "static/refresh.js" in text and 'data-refresh="/hardware?fragment=1"' in text
    # One collection per render: samples() runs every collector whatever the prefix.
    assert service.prefixes == ["traind_"]


def test_hardware_page_without_gpus(fake_service: Any, canned: Any) -> None:
    svc = fake_service(metric_samples=[*canned["host"](), *canned["gpu"](0)])
    with TestClient(create_app(svc)) as c:
        text = c.get("/hardware").text
    # The reason NVML gave (the fake's: no library), else that it reports none.
    assert "No NVIDIA GPU on this node (NVML: NVML Shared Library Not Found)" in text
    assert "gpu-card" not in text
    assert "96.2 GiB / 251.5 GiB" in text  # the host is still shown
    svc.hardware = HardwareHistory([], gpu_enabled=True)
    with TestClient(create_app(svc)) as c:
        assert "No NVIDIA GPU on this node (NVML reports none)" in c.get("/hardware").text


def test_hardware_page_with_no_samples_at_all(fake_service: Any) -> None:
    # A daemon whose collectors are all off: the page still renders, with dashes.
    with TestClient(create_app(fake_service())) as c:
        r = c.get("/hardware")
    assert r.status_code == 200
    assert "No NVIDIA GPU on this node" in r.text and "No processes reported." in r.text


def test_hardware_fragment_is_the_panel_only(client: TestClient) -> None:
    r = client.get("/hardware?fragment=1")
    assert r.status_code == 200
    assert "<html" not in r.text and "<nav" not in r.text
    assert 'id="gpu-0"' in r.text


def test_comm_page_with_two_ranks(client: TestClient, service: Any) -> None:
    r = client.get("/comm")
    assert r.status_code == 200
    text = r.text
    assert 'href="/comm" aria-current="page"' in text
    assert "Communication metrics appear" not in text
    assert 'href="/runs/3"' in text
    assert "powersgd" in text and "412.5 GiB" in text and "6.4 GiB" in text
    assert "64.4\u00d7" in text and "8.7%" in text and "18.62 s" in text
    assert "96,000" in text
    # Rank 1 waits least: it is the straggler, and the only row with the badge.
    assert text.count("least wait</span>") == 1
    assert "straggler rank shows the <em>least</em> all-reduce wait" in text
    assert 'id="chart-busbw"' in text and "/static/vendor/plotly.min.js?v=" in text
    assert "4 KiB" in text and "64 MiB" in text and "Rank 1" in text
    assert service.prefixes == ["traind_"]  # one collection: comm_ and link_ series


def test_comm_page_without_ddp(fake_service: Any, canned: Any) -> None:
    with TestClient(create_app(fake_service(metric_samples=canned["host"]()))) as c:
        text = c.get("/comm").text
    assert "Communication metrics appear when a job runs on more than one rank" in text
    assert 'id="chart-busbw"' not in text and "comm-table" not in text


def test_comm_fragment_carries_the_chart_data(client: TestClient) -> None:
    text = client.get("/comm?fragment=1").text
    assert "<html" not in text
    start = text.index('<script type="application/json" id="probe-data">') + len(
        '<script type="application/json" id="probe-data">'
    )
    traces = json.loads(text[start : text.index("</script>", start)])
    assert [t["name"] for t in traces] == ["all_reduce rank 0", "all_reduce rank 1"]
    assert traces[0]["x"][0] == 4096 and traces[0]["text"][0] == "4 KiB"


def test_api_samples(client: TestClient) -> None:
    r = client.get("/api/samples", params={"prefix": "traind_gpu_power"})
    assert r.status_code == 200
    body = r.json()
    assert {s["name"] for s in body} == {"traind_gpu_power_watts", "traind_gpu_power_limit_watts"}
    assert {"name": "traind_gpu_power_limit_watts", "labels": {"gpu": "0"}, "value": 700.0} in body
    assert client.get("/api/samples", params={"prefix": "traind_nothing_"}).json() == []


def test_api_samples_shows_nan_as_null(fake_service: Any) -> None:
    # JSON has no NaN; a gauge that is NaN (no data yet) must not break the response.
    nan = MetricSample("traind_train_loss", {"run": "1", "rank": "0"}, float("nan"))
    with TestClient(create_app(fake_service(metric_samples=[nan]))) as c:
        r = c.get("/api/samples", params={"prefix": "traind_train_"})
    assert r.status_code == 200 and r.json()[0]["value"] is None


@pytest.mark.parametrize("prefix", ["", "node_", "process_", "Traind_gpu"])
def test_api_samples_refuses_other_prefixes(client: TestClient, service: Any, prefix: str) -> None:
    r = client.get("/api/samples", params={"prefix": prefix})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "prefix"]
    assert service.prefixes == []  # refused before anything was collected


def test_api_samples_needs_a_prefix(client: TestClient) -> None:
    r = client.get("/api/samples")
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "prefix"]


class _StalledSocket:
    """A websocket whose client stopped reading after the first message: every later send
    waits forever, as one does behind a full write buffer."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed: tuple[int, str] | None = None

    async def send_json(self, message: Any) -> None:
        import anyio

        if self.sent:
            await anyio.sleep_forever()
        self.sent.append(message)

    async def close(self, code: int, reason: str = "") -> None:
        self.closed = (code, reason)


def test_a_client_that_stops_reading_is_let_go() -> None:
    import anyio

    from traind.web.routes import live

    async def messages() -> Any:
        for i in range(1000):
            yield {"step": i}

    ws = _StalledSocket()

    async def go() -> None:
        with anyio.fail_after(5):  # _forward returns on its own, not by this deadline
            await live._forward(ws, messages(), send_timeout=0.2)  # type: ignore[arg-type]

    # in a thread of its own: the browser tests leave an event loop running in this one
    errors: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(go)
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and not errors, errors
    assert ws.sent == [{"step": 0}]
    assert ws.closed == (1008, "client stopped reading")


def test_text_assets_are_gzipped_and_there_is_a_favicon(client: TestClient) -> None:
    for path in ("/static/vendor/plotly.min.js", "/static/style.css", "/runs"):
        plain = client.get(path, headers={"Accept-Encoding": "identity"})
        zipped = client.get(path, headers={"Accept-Encoding": "gzip"})
        assert plain.headers.get("content-encoding") is None, path
        assert zipped.headers["content-encoding"] == "gzip", path
        # decoded by the client: the same bytes. The runs page shows a running run's age in
        # seconds, which may tick between the two fetches: its numbers are compared as
        # numbers were there, not by value (a 1-in-20 flake before).
        if path == "/runs":
            assert re.sub(rb"\d+", b"0", zipped.content) == re.sub(rb"\d+", b"0",
                                                                  plain.content)
        else:
            assert zipped.content == plain.content
        assert zipped.num_bytes_downloaded < len(plain.content) / 2, path  # on the wire
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.text.startswith("<svg")
    assert 'rel="icon" href="/favicon.ico"' in client.get("/").text


def test_the_api_docs_load_their_files_from_the_daemon(client: TestClient) -> None:
    for path, marker in (("/api/docs", "swagger-ui"), ("/api/redoc", "redoc")):
        page = client.get(path)
        assert page.status_code == 200 and marker in page.text, path
        assert "cdn." not in page.text and "fonts.googleapis" not in page.text, path
        csp = page.headers["content-security-policy"]
        assert "https:" not in csp and "cdn" not in csp
        assets = re.findall(r'"(/static/vendor/docs/[^"]+)"', page.text)
        assert assets, path
        for asset_path in assets:
            asset = client.get(asset_path)
            assert asset.status_code == 200 and len(asset.content) > 100_000, asset_path
            assert "immutable" in asset.headers["cache-control"]
    assert client.get("/static/vendor/docs/index.html").status_code == 422  # fixed names
