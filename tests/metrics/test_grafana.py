"""Dashboards as code: the files cannot drift, every panel's PromQL answers from a real
Prometheus scraping a real daemon, and `traind grafana push` speaks Grafana's HTTP API."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.conftest import (
    REPO,
    DaemonProc,
    free_port,
    require_real_part,
    running_prometheus,
    start_daemon,
    stop_daemon,
)
from traind.cli.grafana import PushError, grafana_app, push_dashboards
from traind.metrics import grafana

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# Grafana's own variables, as the live test expands them: every value of a multi-select
# ("All" is ".*"), and a rate window of several 1 s scrapes.
EXPANSIONS = {"$__rate_interval": "30s", "$instance": ".*", "$run": ".*", "$rank": ".*",
              "$method": ".*", "$gpu": ".*"}
# A panel that needs an optional family is checked only when the daemon exports it. For GPUs
# a per-device family: the collector's own success gauge is there on hosts without one.
NEED_FAMILY = {"gpu": "traind_gpu_utilization_ratio", "per_layer": "traind_layer_",
               "probe": "traind_comm_probe_", "adaptive": "traind_precision_switches_total",
               "pipeline": "traind_pipeline_"}


def expand(expr: str) -> str:
    # Longest names first, so "$run" never eats the start of a longer variable.
    for var in sorted(EXPANSIONS, key=len, reverse=True):
        expr = expr.replace(var, EXPANSIONS[var])
    return expr


# --- the catalog and the files --------------------------------------------------------


def test_every_dashboard_has_panels_with_unique_titles():
    for key in grafana.DASHBOARDS:
        titles = [p.title for p in grafana.PANELS if p.dashboard == key]
        assert titles, key
        assert len(titles) == len(set(titles)), key
    assert {p.dashboard for p in grafana.PANELS} <= set(grafana.DASHBOARDS)


def test_panels_use_only_their_dashboards_variables():
    for p in grafana.PANELS:
        allowed = {"__rate_interval", *grafana.DASHBOARDS[p.dashboard].variables}
        for q in p.exprs:
            used = set(re.findall(r"\$(\w+)", q.expr))
            assert used <= allowed, (p.title, used - allowed)


def test_gpu_families_are_marked_gpu_only():
    for p in grafana.PANELS:
        if any("traind_gpu_" in q.expr for q in p.exprs):
            assert p.gpu_only, p.title
        if any("traind_layer_" in q.expr for q in p.exprs):
            assert p.needs_per_layer, p.title
        if any("traind_experiments_" in q.expr for q in p.exprs):
            assert not p.future, p.title  # the scheduler collector exports them all


def test_gpu_panels_use_the_gpu_collectors_family_names():
    shape = pytest.importorskip("traind.metrics.gpu_shape")
    known = {f"traind_gpu_{k}" for k in (*shape.GPU_FAMILIES, *shape.LINK_FAMILIES)}
    known |= {"traind_gpu_collector_success", "traind_gpu_info"}
    for p in grafana.PANELS:
        for q in p.exprs:
            for name in re.findall(r"traind_gpu_\w+", q.expr):
                assert name.removesuffix("_total") in known, (p.title, name)


def test_dashboard_json_holds_exactly_the_catalog_queries():
    for key, spec in grafana.DASHBOARDS.items():
        d = grafana.dashboard(key)
        assert d["uid"] == spec.uid
        panels: list[dict[str, Any]] = d["panels"]  # type: ignore[assignment]
        got = [(p["title"], [t["expr"] for t in p["targets"]]) for p in panels]
        want = [(p.title, [q.expr for q in p.exprs]) for p in grafana.PANELS
                if p.dashboard == key]
        assert got == want
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        variables = d["templating"]["list"]  # type: ignore[index]
        ds = variables[0]
        assert ds["type"] == "datasource"
        assert ds["current"]["value"] == grafana.DATASOURCE_UID
        assert [v["name"] for v in variables[1:]] == list(spec.variables)
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids))


def test_checked_in_files_equal_a_fresh_generation():
    stale = []
    for rel, text in grafana.files().items():
        path = REPO / "docker" / rel
        if not path.is_file() or path.read_text() != text:
            stale.append(rel)
    on_disk = {p.name for p in (REPO / "docker/grafana/dashboards").glob("*.json")}
    assert on_disk == {f"{k}.json" for k in grafana.DASHBOARDS}
    assert not stale, f"run `traind grafana generate` and commit: {stale}"


def test_generate_writes_every_file_and_drops_stale_dashboards(tmp_path: Path):
    old = tmp_path / "grafana/dashboards/removed.json"
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    written = grafana.generate(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == set(grafana.files())
    assert not old.exists()
    node = json.loads((tmp_path / "grafana/dashboards/node.json").read_text())
    assert node["title"] == "traind / Node overview"


def test_cli_generate(tmp_path: Path):
    result = CliRunner().invoke(grafana_app, ["generate", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "prometheus/rules.yml").is_file()
    assert (tmp_path / "grafana/provisioning/datasources/prometheus.yaml").is_file()


def test_promtool_accepts_the_recording_rules(tmp_path: Path):
    promtool = require_real_part("promtool", "apt-get install prometheus")
    rules = tmp_path / "rules.yml"
    rules.write_text(grafana.rules_yaml())
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(grafana.RULES) + len(grafana.ALERTS)} rules found" in out.stdout


# --- push, against a fake Grafana that records what it was sent ----------------------


@dataclass
class FakeGrafana:
    url: str
    requests: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)
    # (method, path) -> (status, body); anything else answers 404.
    answers: dict[tuple[str, str], tuple[int, Any]] = field(default_factory=dict)


@pytest.fixture
def fake_grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana(url="")

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            fake.requests.append((self.command, self.path, dict(self.headers), body))
            status, answer = fake.answers.get((self.command, self.path),
                                              (404, {"message": "not found"}))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


def test_push_creates_the_folder_and_overwrites_each_dashboard(fake_grafana: FakeGrafana):
    fake_grafana.answers = {
        ("POST", "/api/folders"): (200, {"uid": "traind", "title": "traind"}),
        ("POST", "/api/dashboards/db"): (200, {"status": "success"}),
    }
    result = CliRunner().invoke(grafana_app, ["push", "--url", fake_grafana.url,
                                              "--token", "glsa_secret"])
    assert result.exit_code == 0, result.output
    calls = [(m, p) for m, p, _, _ in fake_grafana.requests]
    assert calls[:2] == [("GET", "/api/folders/traind"), ("POST", "/api/folders")]
    assert fake_grafana.requests[1][3] == {"title": "traind", "uid": "traind"}
    posts = [r for r in fake_grafana.requests if r[1] == "/api/dashboards/db"]
    assert [body["dashboard"]["uid"] for _, _, _, body in posts] == [
        d.uid for d in grafana.DASHBOARDS.values()]
    for _, _, headers, body in posts:
        assert headers["Authorization"] == "Bearer glsa_secret"
        assert body["overwrite"] is True
        assert body["folderUid"] == "traind"
        assert body["dashboard"]["id"] is None
        assert body["dashboard"]["panels"]


def test_push_into_an_existing_folder_skips_creating_it(fake_grafana: FakeGrafana):
    fake_grafana.answers = {
        ("GET", "/api/folders/ml"): (200, {"uid": "ml", "title": "ml"}),
        ("POST", "/api/dashboards/db"): (200, {"status": "success"}),
    }
    uids = push_dashboards(fake_grafana.url, "t", [grafana.dashboard("node")], folder="ml")
    assert uids == ["traind-node"]
    assert [p for _, p, _, _ in fake_grafana.requests] == ["/api/folders/ml",
                                                           "/api/dashboards/db"]


def test_push_errors_name_the_url_and_the_status(fake_grafana: FakeGrafana):
    fake_grafana.answers = {
        ("GET", "/api/folders/traind"): (200, {"uid": "traind"}),
        ("POST", "/api/dashboards/db"): (403, {"message": "Access denied"}),
    }
    with pytest.raises(PushError) as err:
        push_dashboards(fake_grafana.url, "t", [grafana.dashboard("gpu")])
    assert fake_grafana.url in str(err.value)
    assert "HTTP 403" in str(err.value)
    assert "traind-gpu" in str(err.value)
    result = CliRunner().invoke(grafana_app, ["push", "--url", fake_grafana.url,
                                              "--token", "t"])
    assert result.exit_code == 1
    assert "HTTP 403" in result.output


def test_push_to_nothing_listening_says_so():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PushError, match=re.escape(url) + r".*no HTTP answer"):
        push_dashboards(url, "t", [], timeout=2)


# --- every panel against a real Prometheus scraping a real daemon ---------------------


@pytest.fixture(scope="module")
def comm_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """Like the shared `daemon`, but two gloo ranks with int8 compression, so the
    communication panels have series (one rank has no gradient collective)."""
    with pytest.MonkeyPatch.context() as mp:
        # The daemon reads TRAIND_* at start-up (start_daemon passes os.environ on).
        mp.setenv("TRAIND_JOB__NPROC_PER_NODE", "2")
        mp.setenv("TRAIND_COMPRESSION__METHOD", "int8")
        mp.setenv("TRAIND_JOB__CHECKPOINT_EVERY", "20")
        d = start_daemon(tmp_path_factory.mktemp("grafana-daemon"), steps=1_000_000)
    yield d
    stop_daemon(d)


@pytest.fixture
def prometheus(prometheus_bin: str, comm_daemon: DaemonProc, tmp_path: Path) -> Iterator[str]:
    rules = tmp_path / "rules.yml"
    rules.write_text(grafana.rules_yaml())
    config = tmp_path / "prometheus.yml"
    # JSON is YAML: no YAML library needed for the config.
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "traind", "static_configs": [
            {"targets": [f"127.0.0.1:{comm_daemon.port}"]}]}],
    }))
    with running_prometheus(prometheus_bin, config, tmp_path / "tsdb",
                            tmp_path / "prometheus.log") as url:
        yield url


def query(url: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expand(expr)}, timeout=10)
    return r.json()  # type: ignore[no-any-return]


def variable_expr(q: str) -> str:
    """Grafana's label_values(selector, label) as the PromQL that lists the same values."""
    sel, label = re.fullmatch(r"label_values\((.*), (\w+)\)", q).groups()  # type: ignore[union-attr]
    return f"count by ({label}) ({sel})"


@pytest.mark.slow
def test_every_panel_returns_data_from_a_real_prometheus(prometheus: str,
                                                         comm_daemon: DaemonProc):
    # Every expression must parse, including those for hardware this machine lacks.
    for p in grafana.PANELS:
        for q in p.exprs:
            answer = query(prometheus, q.expr)
            assert answer["status"] == "success", (p.title, q.expr, answer)

    scrape = comm_daemon.get("/metrics").text
    exported = {line.split("{")[0].split(" ")[0] for line in scrape.splitlines()
                if line and not line.startswith("#")}

    def present(need: str | None) -> bool:
        if need is None:
            return True
        family = NEED_FAMILY.get(need)
        return family is not None and any(name.startswith(family) for name in exported)

    pending = {(p.title, q.expr) for p in grafana.PANELS if present(p.needs) for q in p.exprs}
    pending |= {(f"variable {v.name}", variable_expr(v.query))
                for v in grafana.VARIABLES.values()
                if v.name != "gpu" or present("gpu")}
    # Rates need two scrapes inside their window and the quantile rules an evaluation
    # after that; a slow first step or an evaluation at 20 steps takes a little longer.
    deadline = time.monotonic() + 45
    while pending and time.monotonic() < deadline:
        pending = {(title, expr) for title, expr in pending
                   if not query(prometheus, expr)["data"]["result"]}
        if pending:
            time.sleep(1)
    assert not pending, "no data for:\n" + "\n".join(f"{t}: {e}" for t, e in sorted(pending))


def test_the_comm_dashboard_splits_bytes_and_time_by_mesh_dim_and_the_bubble_by_stage():
    panels = {p.title: p for p in grafana.PANELS if p.dashboard == "comm"}
    by_dim = [p for p in panels.values()
              if any("by (run, mesh_dim)" in q.expr or "mesh_dim)" in q.expr for q in p.exprs)]
    families = {name for p in by_dim for q in p.exprs
                for name in re.findall(r"traind_comm_\w+", q.expr)}
    assert {"traind_comm_collective_bytes_total", "traind_comm_allreduce_seconds_total"} <= families
    bubble = panels["Pipeline bubble by stage"]
    assert bubble.needs == "pipeline" and all("stage" in q.legend for q in bubble.exprs)
    assert panels["Pipeline activation bytes per step by stage"].needs == "pipeline"
    assert panels["Pipeline P2P wait per step by stage"].needs == "pipeline"
