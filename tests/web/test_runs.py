"""A run's page and its API (series, CSV export, stop) against the fake service."""

from __future__ import annotations

import csv
import html
import io
import json
import re
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest

from tests.web.conftest import T0, sample_runs
from traind.contracts.states import RUN_STATES
from traind.daemon.service import ExperimentInfo
from traind.web.app import create_app as _create_app
from traind.web.runviews import config_differences, config_rows, event_text, legend_names
from traind.web.views import compare_href

if TYPE_CHECKING:

    from fastapi.testclient import TestClient

    from traind.daemon.service import RunView

create_app = partial(_create_app, allowed_hosts=["testserver"])


@pytest.fixture
def client(session_client: TestClient) -> TestClient:
    return session_client


def test_series_is_downsampled_with_an_envelope_that_keeps_the_spike(client: TestClient) -> None:
    r = client.get("/api/runs/1/series", params={"points": 100})
    assert r.status_code == 200
    d = r.json()
    assert d["run"] == 1 and d["points"] == 5000 and len(d["step"]) == 100
    assert d["step"][-1] == 5000 and len(d["time"]) == 100
    loss = d["loss"]
    assert all(lo <= y <= hi for lo, y, hi in zip(loss["lo"], loss["y"], loss["hi"], strict=True))
    assert max(loss["hi"]) > 7.5 > max(loss["y"])  # step 700's spike: in the band, not the mean
    assert d["evals"]["step"][:2] == [500, 1000]
    assert d["layers"]["layers"] == ["embed", "block.0", "block.1", "head"]
    assert len(d["layers"]["grad_norm"]) == 4


def two_ranks(service: Any, run_id: int = 1) -> None:
    """Run ``run_id`` of the sample as a 2-rank job (rank 1 the straggler)."""
    service.run_views = [replace(r, summary={**r.summary, "world_size": 2})
                         if r.id == run_id else r for r in service.run_views]


def test_series_has_a_part_per_rank_when_asked(client: TestClient, service: Any) -> None:
    assert "ranks" not in client.get("/api/runs/1/series").json()  # not unasked
    two_ranks(service)
    d = client.get("/api/runs/1/series", params={"points": 100, "ranks": "true"}).json()
    lines = d["ranks"]["lines"]
    assert [x["rank"] for x in lines] == [0, 1]
    assert all(len(x["step"]) == 100 and x["step"][-1] == 5000 for x in lines)
    assert lines[1]["step_seconds"][10] > lines[0]["step_seconds"][10]
    table = {row["rank"]: row for row in d["ranks"]["table"]}
    assert table[1]["slow"] == ["step_seconds", "forward_seconds"]
    assert table[0]["slow"] == ["backward_seconds"]  # the others wait for it
    one = client.get("/api/runs/3/series", params={"ranks": "true"}).json()["ranks"]
    assert one == {"lines": [], "table": []}  # a run of one rank
    assert client.get("/api/runs/1/series", params={"ranks": "maybe"}).status_code == 422
    page = client.get("/runs/1").text
    assert 'data-ranks="2"' in page and 'id="per-rank"' in page and 'id="ranks-card"' in page
    assert 'id="per-rank"' not in client.get("/runs/3").text


def test_series_has_each_ops_communication_when_asked(client: TestClient,
                                                      service: Any) -> None:
    from tests.web.conftest import synthetic_comm_chunks

    assert "comm" not in client.get("/api/runs/1/series").json()  # not unasked
    service.comm_chunks[1] = synthetic_comm_chunks(range(1, 5001))
    d = client.get("/api/runs/1/series", params={"points": 100, "comm": "true"}).json()
    ops = {x["op"]: x for x in d["comm"]["ops"]}
    assert set(ops) == {"all_gather", "all_reduce"} and d["comm"]["reports"] == 500
    ar = ops["all_reduce"]
    assert len(ar["step"]) == 100 and ar["step"][-1] == 5000
    assert all(a <= b <= c for a, b, c in zip(ar["p50"], ar["p95"], ar["p99"], strict=True))
    assert max(ar["p99"]) > 5 * max(ar["p50"])  # the slow tail the buckets keep
    assert all(v > 0 for v in ar["bus_bandwidth"])
    assert d["comm"]["bytes"]["ratio"][0] == pytest.approx(16.0)
    one = client.get("/api/runs/3/series", params={"comm": "true"}).json()["comm"]
    assert one["ops"] == [] and one["bytes"]["step"] == []  # a run of one rank
    doc = client.get("/api/openapi.json").json()["paths"]["/api/runs/{run_id}/series"]
    names = {p["name"] for p in doc["get"]["parameters"]}
    assert {"points", "ranks", "comm", "after"} <= names
    assert "comm=true" in doc["get"]["description"] and "after=STEP" in doc["get"]["description"]


def test_a_polls_tail_is_what_came_since_the_step(client: TestClient, service: Any) -> None:
    from tests.web.conftest import synthetic_comm_chunks

    two_ranks(service)
    service.comm_chunks[1] = synthetic_comm_chunks(range(1, 5001))
    d = client.get("/api/runs/1/series", params={
        "points": 100, "after": 4990, "ranks": "true", "comm": "true"}).json()
    assert d["after"] == 4990 and d["points"] == 10 and d["more"] is False
    assert d["step"] == list(range(4991, 5001)) and set(d["loss"]) == {"y"}
    assert d["evals"]["step"] == [5000] and d["layers"]["step"] == []
    assert [x["step"][0] for x in d["ranks"]["lines"]] == [4990, 4990]
    assert "table" not in d["ranks"]
    assert d["comm"]["bytes"]["step"] == [4990, 5000]
    assert all(x["step"] == [4990, 5000] for x in d["comm"]["ops"])
    capped = client.get("/api/runs/1/series", params={"points": 10, "after": 100}).json()
    assert capped["step"] == list(range(101, 111)) and capped["more"] is True
    assert client.get("/api/runs/1/series", params={"after": -2}).status_code == 422


@pytest.mark.parametrize("points", [0, 9, 20_001, "many"])
def test_a_bad_points_count_is_named(client: TestClient, points: Any) -> None:
    r = client.get("/api/runs/1/series", params={"points": points})
    assert r.status_code == 422 and "points" in r.text


def test_unknown_runs_are_404_everywhere(client: TestClient, auth: dict[str, str]) -> None:
    for path in ("/api/runs/99", "/api/runs/99/series", "/api/runs/99/series.csv", "/runs/99"):
        assert client.get(path).status_code == 404, path
    assert client.post("/api/runs/99/stop", headers=auth).status_code == 404


def test_the_export_has_every_step(client: TestClient) -> None:
    r = client.get("/api/runs/1/series.csv")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert 'filename="run-1.csv"' in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 5000 and rows[0]["step"] == "1" and rows[-1]["step"] == "5000"
    assert set(rows[0]) == {"step", "time", "loss", "lr", "grad_norm", "tokens_per_second",
                            "step_seconds", "data_seconds", "val_loss"}
    assert float(rows[699]["loss"]) > 7.5  # full resolution: the spike itself


def test_stop_needs_the_token_and_a_running_run(client: TestClient, service: Any,
                                                auth: dict[str, str]) -> None:
    assert client.post("/api/runs/3/stop").status_code == 401
    assert service.stopped == []
    r = client.post("/api/runs/3/stop", headers=auth)
    assert r.status_code == 202 and r.json()["id"] == 3 and service.stopped == [3]
    done = client.post("/api/runs/1/stop", headers=auth)
    assert done.status_code == 409 and "not running" in done.json()["detail"]


def test_a_link_probe_needs_the_token_and_a_running_run(client: TestClient, service: Any,
                                                       auth: dict[str, str]) -> None:
    assert client.post("/api/runs/3/probe-links").status_code == 401
    r = client.post("/api/runs/3/probe-links", headers=auth)
    assert r.status_code == 202 and r.json()["id"] == 3 and service.probed == [3]
    done = client.post("/api/runs/1/probe-links", headers=auth)
    assert done.status_code == 409 and "more than one rank" in done.json()["detail"]
    assert client.post("/api/runs/99/probe-links", headers=auth).status_code == 404


def test_the_links_panel_measures_again_with_a_session(client: TestClient,
                                                       service: Any) -> None:
    from tests.web.test_linkviews import link_samples

    service.metric_samples = link_samples("3", 2)
    text = client.get("/comm").text
    assert 'id="probe-links-form"' in text and 'action="/runs/3/probe-links"' in text
    m = re.search(r'name="csrf_token" value="([^"]+)"', text)
    assert m
    bad = client.post("/runs/3/probe-links", data={"csrf_token": "wrong"},
                      follow_redirects=False)
    assert bad.status_code == 403 and service.probed == []
    ok = client.post("/runs/3/probe-links", data={"csrf_token": m.group(1)},
                     follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/comm#links"
    assert service.probed == [3]


def test_the_run_page_has_its_charts_config_events_and_a_confirmed_stop(
    client: TestClient, service: Any
) -> None:
    service.run_experiments[3] = [{"id": 4, "name": "int8-vs-none", "state": "running",
                                   "role": "interleaved"}]
    r = client.get("/runs/3")
    assert r.status_code == 200
    text = r.text
    for chart in ("chart-loss", "chart-tps", "chart-gradnorm", "chart-lr", "chart-step",
                  "chart-layer-grad", "chart-layer-update", "chart-precision"):
        assert f'id="{chart}"' in text
    for tool in ("smoothing", "x-axis", "log-y"):
        assert f'id="{tool}"' in text
    assert 'data-run="3"' in text and "gpt-small-bf16" in text
    assert 'href="/api/runs/3/series.csv"' in text
    assert 'href="/experiments/4"' in text and "its arms interleave" in text
    assert "job.steps = 5000" in text and 'precision.mode = "bf16"' in html.unescape(text)
    assert "skip_step (nonfinite_grad)" in text and "step_00001000.pt" in text
    assert "rank 0: step 1200" in text
    assert 'id="stop-form"' in text and "data-confirm=" in text
    # The form stop: a session and its CSRF token.
    m = re.search(r'name="csrf_token" value="([^"]+)"', text)
    assert m
    bad = client.post("/runs/3/stop", data={"csrf_token": "wrong"}, follow_redirects=False)
    assert bad.status_code == 403 and service.stopped == []
    ok = client.post("/runs/3/stop", data={"csrf_token": m.group(1)}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/runs/3"
    assert service.stopped == [3]


def test_an_ended_run_has_no_stop_and_says_why_it_failed(client: TestClient) -> None:
    text = client.get("/runs/2").text
    assert 'id="stop-form"' not in text and "Why it ended" in text and "&lt;boom&gt;" in text
    assert "Not part of an experiment" in text


def test_the_runs_table_links_each_run_to_its_page(client: TestClient) -> None:
    text = client.get("/runs").text
    for rid in (1, 2, 3):
        assert f'href="/runs/{rid}"' in text


def test_config_rows_are_dotted_keys_in_the_configs_order() -> None:
    rows = config_rows({"job": {"steps": 5, "name": "x"}, "model": {}, "tags": ["a"],
                        "nested": {"a": {"b": None}}})
    assert rows == [("job.steps", "5"), ("job.name", '"x"'), ("model", "{}"),
                    ("tags", '["a"]'), ("nested.a.b", "null")]


@pytest.mark.parametrize(("kind", "data", "text"), [
    ("numerics", {"action": "rollback", "reason": "loss_spike", "resume_step": 40,
                  "skipped_batches": 3},
     "rollback (loss_spike): back to step 40, 3 batches left out"),
    ("numerics", {"action": "skip_step", "reason": "nonfinite_grad"}, "skip_step (nonfinite_grad)"),
    ("checkpoint", {"path": "/r/step_1.pt", "seconds": 0.5, "sharded": True},
     "/r/step_1.pt (500 ms, sharded)"),
    ("resumed", {"step": 20, "path": "/r/step_20.pt"}, "from step 20 (/r/step_20.pt)"),
    ("finished", {"stopped": True, "loss": 2.0, "val_loss": None},
     "stopped: loss 2.0000, val loss \u2013"),
    ("started", {"ranks": 2, "device": "cpu"}, "ranks=2, device=cpu"),
])
def test_event_lines(kind: str, data: dict[str, Any], text: str) -> None:
    assert event_text(kind, data) == text


def test_the_openapi_document_lists_the_run_routes(client: TestClient) -> None:
    paths = client.get("/api/openapi.json").json()["paths"]
    assert {"/api/runs/{run_id}", "/api/runs/{run_id}/series", "/api/runs/{run_id}/series.csv",
            "/api/runs/{run_id}/stop", "/api/runs/{run_id}/probe-links"} <= set(paths)
    assert paths["/api/runs/{run_id}/probe-links"]["post"]["security"] == [{"HTTPBearer": []}]
    assert paths["/api/runs/{run_id}/stop"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "/runs/{run_id}" not in paths



def many_runs(n: int = 200) -> list[RunView]:
    """``n`` runs, newest first: every state in turn, a loss that is not in id order."""
    base = sample_runs()[0]
    return [replace(base, id=i, name=f"{'sweep' if i % 3 else 'base'}-{i:03d}",
                    state=RUN_STATES[i % len(RUN_STATES)],
                    summary={"loss": round(2 + ((i * 37) % 200) / 100, 2), "step": i})
            for i in range(n, 0, -1)]


def filterable(service: Any, forked: tuple[int, ...] = tuple(range(20, 32))) -> int:
    """Give ``many_runs`` configs (odd ids bf16, ids of 1 mod 4 also powersgd) and a forked
    experiment whose trials ran as ``forked``; its id."""
    service.configs = {r.id: {"job": {"name": r.name},
                              "precision": {"mode": "bf16" if r.id % 2 else "fp32"},
                              "compression": {"method": "powersgd" if r.id % 4 == 1 else "none",
                                              "rank": 4}}
                       for r in service.run_views}
    info = ExperimentInfo(
        id=7, name="powersgd-vs-none", state="done", mode="forked", arms=("none", "powersgd"),
        run_id=None, verdict=None, config_hash="0000abcd", versions={"traind": "0.1.0"},
        created_at=T0, finished_at=T0, trial_runs=forked)
    service.experiment_infos[7] = info
    return 7


def row_ids(text: str) -> list[int]:
    return [int(m) for m in re.findall(r'<tbody class="run" id="run-(\d+)"', text)]


def test_the_runs_table_sorts_filters_and_pages_200_runs(client: TestClient,
                                                         service: Any) -> None:
    service.run_views = many_runs()
    first = client.get("/runs").text
    assert row_ids(first) == list(range(200, 150, -1)) and 'id="runs-total">200<' in first
    assert "page 1 of 4" in first and 'href="/runs?page=2"' in first
    assert row_ids(client.get("/runs?page=4").text) == list(range(50, 0, -1))
    by_loss = client.get("/runs?sort=loss&order=asc").text
    losses = [r.summary["loss"] for r in sorted(service.run_views, key=lambda r: (
        r.summary["loss"], -r.id))][:50]
    got = {r.id: r.summary["loss"] for r in service.run_views}
    assert [got[i] for i in row_ids(by_loss)] == losses
    assert 'aria-sort="ascending"' in by_loss
    # The loss heading flips to descending; the page link keeps the order.
    assert 'href="/runs?sort=loss&amp;order=desc"' in by_loss
    assert 'href="/runs?sort=loss&amp;order=asc&amp;page=2"' in by_loss
    failed = client.get("/runs?state=stopped&name=SWEEP").text
    ids = row_ids(failed)
    assert ids and all(got[i] and i % 6 == RUN_STATES.index("stopped") and i % 3 for i in ids)
    assert "No runs match." in client.get("/runs?name=nothing-like-it").text


def test_the_runs_table_filters_by_experiment_and_config_key(client: TestClient,
                                                             service: Any) -> None:
    service.run_views = many_runs()
    exp = filterable(service)
    # What the form sends with "any" state and an empty experiment: no filter, not a 422.
    r = client.get("/runs", params={"state": "", "name": "", "experiment": "", "config": ""})
    assert r.status_code == 200 and 'id="runs-total">200<' in r.text
    page = client.get("/runs", params={"experiment": exp, "config": "precision.mode=bf16",
                                       "sort": "loss", "order": "asc"}).text
    ids = row_ids(page)
    assert sorted(ids) == [21, 23, 25, 27, 29, 31]
    # Sorting and the clear link keep (and drop) the filters.
    assert ('href="/runs?experiment=7&amp;config=precision.mode%3Dbf16&amp;sort=loss'
            '&amp;order=desc"') in page
    assert 'value="precision.mode=bf16"' in page and 'href="/runs">clear</a>' in page
    api = client.get("/api/runs", params={"config": "compression.method=powersgd",
                                          "experiment": exp}).json()
    assert [x["id"] for x in api] == [29, 25, 21]
    assert client.get("/api/runs", params={"config": "compression.rank=4"}).json()
    many = client.get("/runs", params={"config": "compression.method=powersgd"}).text
    assert 'id="runs-total">50<' in many
    assert "No runs match." in client.get("/runs?experiment=99").text


def test_the_experiment_page_links_its_runs_in_the_table(client: TestClient,
                                                         service: Any) -> None:
    service.run_views = many_runs()
    exp = filterable(service)
    text = client.get(f"/experiments/{exp}").text
    assert f'href="/runs?experiment={exp}" id="runs-table-link"' in text


@pytest.mark.parametrize(("params", "field"), [
    ({"sort": "config"}, "sort"), ({"state": "exploded"}, "state"), ({"order": "up"}, "order"),
    ({"name": "x" * 65}, "name"), ({"page": 0}, "page"),
    ({"experiment": 0}, "experiment"), ({"experiment": "x"}, "experiment"),
    ({"config": "precision.mode"}, "config"), ({"config": "precision..mode=x"}, "config"),
    ({"config": "a'); DROP TABLE runs; --=1"}, "config"), ({"config": "../x=1"}, "config"),
    ({"config": "a=" + "x" * 300}, "config"),
])
def test_a_bad_runs_query_is_named(client: TestClient, params: dict[str, Any],
                                   field: str) -> None:
    for path in ("/api/runs", "/runs"):
        if path == "/api/runs" and field == "page":
            continue
        r = client.get(path, params=params)
        assert r.status_code == 422 and field in r.text, (path, r.text[:300])
        assert [field] == [e["loc"][-1] for e in r.json()["detail"]], r.text[:300]


def test_the_api_lists_runs_with_the_same_query(client: TestClient, service: Any) -> None:
    service.run_views = many_runs()
    r = client.get("/api/runs", params={"state": "running", "sort": "loss", "limit": 5})
    rows = r.json()
    assert len(rows) == 5 and {x["state"] for x in rows} == {"running"}
    assert [x["summary"]["loss"] for x in rows] == sorted(
        (x["summary"]["loss"] for x in rows), reverse=True)


def _config(name: str, mode: str, lr: float) -> dict[str, Any]:
    return {"job": {"name": name, "steps": 5000}, "precision": {"mode": mode},
            "optim": {"lr": lr, "betas": [0.9, 0.95]}}


def test_compare_overlays_runs_under_the_settings_that_differ(client: TestClient,
                                                             service: Any) -> None:
    service.configs = {1: _config("baseline", "fp32", 1e-3), 3: _config("gpt", "bf16", 1e-3),
                       2: _config("x", "bf16", 3e-3)}
    r = client.get("/runs/compare", params=[("ids", 3), ("ids", 1), ("ids", 3)])
    assert r.status_code == 200
    text = html.unescape(r.text)
    assert 'data-runs="3,1"' in text  # the order given, each run once
    rows = re.findall(r"<tr><td><code>([^<]+)</code></td>", text)
    assert rows == ["job.name", "precision.mode"]  # what is the same is not listed
    names = json.loads(re.search(r"data-names=\"([^\"]*)\"", r.text).group(1)  # type: ignore[union-attr]
                       .replace("&#34;", '"').replace("&quot;", '"'))
    assert names == {"3": '#3 gpt-small-bf16 · precision.mode="bf16"',
                     "1": '#1 baseline · precision.mode="fp32"'}
    for chart in ("chart-loss", "chart-tps", "chart-gradnorm", "chart-lr", "chart-step"):
        assert f'id="{chart}"' in text
    assert "chart-layer-grad" not in text  # heat maps are a single run's


@pytest.mark.parametrize("ids", [[1], [1, 1], list(range(1, 10))])
def test_compare_needs_two_to_eight_runs(client: TestClient, ids: list[int]) -> None:
    r = client.get("/runs/compare", params=[("ids", i) for i in ids])
    assert r.status_code == 422 and "ids" in r.text


def test_compare_of_an_unknown_run_is_404(client: TestClient) -> None:
    assert client.get("/runs/compare?ids=1&ids=99").status_code == 404
    assert client.get("/runs/compare").status_code == 422  # no ids at all


def test_the_runs_table_picks_runs_to_compare(client: TestClient) -> None:
    text = client.get("/runs").text
    assert 'action="/runs/compare" id="compare-form"' in text
    for rid in (1, 2, 3):
        assert f'name="ids" value="{rid}" form="compare-form"' in text


def test_config_differences_and_legend_names() -> None:
    configs = [_config("a", "fp32", 1e-3), _config("b", "bf16", 3e-3), {"job": {"name": "c"}}]
    diff = config_differences(configs)
    assert diff == [("job.name", ['"a"', '"b"', '"c"']),
                    ("job.steps", ["5000", "5000", "\u2013"]),
                    ("precision.mode", ['"fp32"', '"bf16"', "\u2013"]),
                    ("optim.lr", ["0.001", "0.003", "\u2013"]),
                    ("optim.betas", ["[0.9, 0.95]", "[0.9, 0.95]", "\u2013"])]
    names = legend_names([(1, "a"), (2, "b"), (3, "c")], diff)
    assert names[1] == '#1 a · job.steps=5000 · precision.mode="fp32"'  # .name tells nothing
    assert legend_names([(1, "a"), (2, "b")], []) == {1: "#1 a", 2: "#2 b"}


@pytest.mark.parametrize(("ids", "href"), [
    ((), None), ((4,), None), ((4, 4), None), ((4, 5, 4), "/runs/compare?ids=4&ids=5"),
    (tuple(range(1, 12)), "/runs/compare?" + "&".join(f"ids={i}" for i in range(1, 9))),
])
def test_compare_href(ids: tuple[int, ...], href: str | None) -> None:
    assert compare_href(ids) == href


def test_a_forked_experiments_page_links_its_trial_runs_and_their_comparison(
    client: TestClient, service: Any
) -> None:
    from traind.daemon.service import ExperimentInfo

    service.experiment_infos[5] = ExperimentInfo(
        id=5, name="fp32-vs-bf16", state="done", mode="forked", arms=("fp32", "bf16"),
        run_id=None, verdict=None, config_hash="abc", versions={}, created_at=T0,
        finished_at=None, trial_runs=(11, 12, 13, 14))
    text = client.get("/experiments/5").text
    for rid in (11, 12, 13, 14):
        assert f'href="/runs/{rid}"' in text
    assert 'href="/runs/compare?ids=11&amp;ids=12&amp;ids=13&amp;ids=14"' in text
    assert 'id="reused-trials"' not in text
    # a tuner's quality round took two trials of an earlier one (daemon/experiments/reuse.py)
    service.experiment_infos[6] = replace(service.experiment_infos[5], id=6, reused_trials=2)
    text = client.get("/experiments/6").text
    assert re.search(r'id="reused-trials">2 taken from earlier experiments', text), text


def test_an_interleaved_experiments_page_says_whose_pairs_it_carries(
    client: TestClient, service: Any
) -> None:
    from traind.daemon.service import ExperimentInfo

    service.experiment_infos[7] = ExperimentInfo(
        id=7, name="round-2", state="done", mode="interleaved", arms=("fp32", "bf16"),
        run_id=21, verdict=None, config_hash="abc", versions={}, created_at=T0,
        finished_at=None)
    assert 'id="carried-pairs"' not in client.get("/experiments/7").text
    # a tuner's later speed round went on from two earlier ones' pairs
    service.experiment_infos[8] = replace(service.experiment_infos[7], id=8,
                                          carried_from=(3, 5), carried_pairs=20)
    text = client.get("/experiments/8").text
    assert re.search(r'id="carried-pairs">its verdicts go on from up to 20 pairs per arm', text)
    assert 'href="/experiments/3">#3</a>, <a href="/experiments/5">#5</a>' in text, text


def test_the_run_page_shows_where_the_wall_time_went(client: TestClient, service: Any) -> None:
    """Issue 17: the summary's goodput as a ratio, ETTR, a bar and a table."""
    assert 'id="goodput-card"' not in client.get("/runs/1").text  # none folded yet
    goodput = {"wall": 200.0, "productive": 150.0, "committed": 150.0, "attempts": 2,
               "ratio": 0.75, "ettr": 0.82,
               "badput": {"startup": 10.0, "restart": 6.0, "progress_lost": 20.0,
                          "checkpoint_restore": 0.0, "checkpoint_save": 14.0}}
    service.run_views = [replace(r, summary={**r.summary, "goodput": goodput})
                         if r.id == 1 else r for r in service.run_views]
    page = client.get("/runs/1").text
    assert 'id="goodput-card"' in page and "2 attempts" in page
    assert '<dd data-field="goodput">75%</dd>' in page and '<dd data-field="ettr">82%</dd>' in page
    rows = re.findall(r'<tr data-kind="([a-z_]+)">', page)
    assert rows == ["productive", "progress_lost", "checkpoint_save", "startup", "restart"]
    assert 'class="goodput-progress_lost" style="width: 10.0%"' in page
    overview = client.get("/", params={"run": 1}).text
    assert re.search(r'data-field="goodput"[^>]*>75%<', overview)
    assert re.search(r'data-field="ettr"[^>]*>82%<', overview)


def test_the_run_page_names_the_straggler_or_says_chance_explains_it(
        client: TestClient, service: Any) -> None:
    """Issue 17: the summary's straggler verdict (metrics/straggler.py) in one sentence."""
    assert 'id="straggler"' not in client.get("/runs/1").text  # one rank: no verdict
    named = {"rank": 1, "candidate": 1, "confidence": 0.99999, "share": 0.98, "lag": 0.0512,
             "steps": 40, "error": 0.0035, "skew": 0.05, "at_step": 40}
    service.run_views = [replace(r, summary={**r.summary, "world_size": 3, "straggler": named})
                         if r.id == 1 else r for r in service.run_views]
    text = html.unescape(client.get("/runs/1").text)
    assert "Rank 1 is the straggler: last at the gradient collectives in 98% of the last 40 " \
           "steps, by 51.2 ms (median)" in text
    nobody = {**named, "rank": None, "candidate": 0, "share": 0.4, "lag": 0.0033}
    service.run_views = [replace(r, summary={**r.summary, "straggler": nobody})
                         if r.id == 1 else r for r in service.run_views]
    text = html.unescape(client.get("/runs/1").text)
    assert "No straggler: the most often last, rank 0, was last at the gradient collectives " \
           "in 40% of the last 40 steps (by 3.3 ms), which chance or the clocks' error " \
           "(3.5 ms) explains." in text


def test_the_run_page_shows_its_data_filters_and_cache_tiers(
        client: TestClient, service: Any) -> None:
    """Issue 18: the prepared data's filter report and the cache tiers, from the summary."""
    from traind.contracts.events import DataEvent
    from traind.daemon.runs.summary import data_summary

    assert 'id="data-card"' not in client.get("/runs/1").text  # no data report yet
    event = DataEvent(
        rank=0, step=10, cache_hits={}, cache_misses={}, cache_write_errors=0,
        filtered={"empty": 3, "duplicate": 0, "near_duplicate": 22},
        documents_kept=772, bytes_kept=0, batches_served=10, prefetch_capacity=0,
        prefetch_depth_mean=0.0, prefetch_depth_last=0, prefetch_wait_seconds=0.012,
        tokens_kept=12_187_768, filtered_bytes={"empty": 0, "near_duplicate": 414_322},
        filtered_tokens={"empty": 0, "near_duplicate": 101_250},
        tier_hits={"host": 0, "page_cache": 9}, tier_misses={"host": 10, "page_cache": 1},
        tier_wait_seconds={"host": 0.012, "page_cache": 0.004})
    service.run_views = [replace(r, summary={**r.summary, "data": data_summary(event)})
                         if r.id == 1 else r for r in service.run_views]
    page = client.get("/runs/1").text
    assert 'id="data-card"' in page and "12,187,768 tokens from 772 documents" in page
    assert re.findall(r'<tr data-reason="([a-z_]+)">', page) == ["empty", "near_duplicate"]
    assert "404.6 KiB" in page and "101,250" in page  # the near-duplicates' bytes, tokens
    tiers = re.findall(r"<tr><td>([a-z ()0-9]+)</td><td class=\"num\">([0-9%.]+)</td>", page)
    assert tiers == [("host ring (tier 2)", "0%"), ("page cache (tier 3)", "90%")]


def test_the_api_names_a_run_s_checkpoint_by_its_file_not_the_node_s_path(
        service: Any) -> None:
    """Issue 40: /api/runs showed absolute paths (the node's folders) to anonymous readers."""
    from fastapi.testclient import TestClient

    path = "/srv/secret-project/var/runs/default-1/step_00000092.pt"
    service.run_views = [replace(r, summary={**r.summary, "last_checkpoint": path})
                         if r.id == 1 else r for r in service.run_views]
    with TestClient(_create_app(service, allowed_hosts=["testserver"])) as anonymous:
        listed = anonymous.get("/api/runs").json()
        one = anonymous.get("/api/runs/1").json()
    [row] = [r for r in listed if r["id"] == 1]
    assert row["summary"]["last_checkpoint"] == one["summary"]["last_checkpoint"] \
        == "step_00000092.pt"
    assert "/srv/" not in json.dumps(listed) + json.dumps(one)


def test_whole_series_reads_take_turns_and_a_client_past_its_share_gets_429(
        service: Any) -> None:
    """Issue 40.5: eight anonymous whole-series reads of a long run at once took the node to
    +470 MB and /healthz to seconds. They take turns (one at a time), a client may have 4
    running or waiting, and a poll's tail (a few chunks) never waits for them."""
    import asyncio
    import threading

    import httpx

    from traind.web.heavy import PER_CLIENT

    release, running = threading.Event(), []
    plain_read = service.run_series

    def slow_read(run_id: int, **kw: Any) -> Any:
        if kw.get("after") is None:
            running.append(run_id)
            assert len(running) == 1, "two whole reads at once"
            release.wait(10)
            running.pop()
        return plain_read(run_id, **kw)

    service.run_series = slow_read
    app = create_app(service, title="t")

    async def main() -> tuple[list[int], int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://testserver", timeout=30) as c:
            reads = [asyncio.create_task(c.get("/api/runs/1/series")) for _ in range(6)]
            refused: list[asyncio.Task[httpx.Response]] = []
            for _ in range(1000):  # answered at once, while the rest wait
                await asyncio.sleep(0.01)
                if len(refused := [t for t in reads if t.done()]) >= 6 - PER_CLIENT:
                    break
            tail = await c.get("/api/runs/1/series?after=10")  # not behind the whole reads
            assert [t.result().status_code for t in refused] == [429] * (6 - PER_CLIENT)
            assert refused[0].result().headers["retry-after"] == "1"
            release.set()
            return [r.status_code for r in await asyncio.gather(*reads)], tail.status_code

    # A thread of its own: a browser test's Playwright may hold a running loop in this one.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        codes, tail = pool.submit(asyncio.run, main()).result()
    assert sorted(codes) == [200] * PER_CLIENT + [429] * (6 - PER_CLIENT) and tail == 200
