"""Auto-tuning, promotions and the queue through the JSON API and the forms, against the fake
service: the token on every POST, 422s that name fields (with nothing stored or reordered),
404/409, CSRF and Origin on the forms, and the pages."""

from __future__ import annotations

import re
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient

from tests.web.conftest import log_in
from traind.daemon.config import ConfigError
from traind.web.app import create_app as _create_app

if TYPE_CHECKING:
    from collections.abc import Iterator

# TestClient sends Host: testserver; the app answers loopback names only unless told.
create_app = partial(_create_app, allowed_hosts=["testserver"])


@pytest.fixture
def client(service: Any) -> Iterator[TestClient]:
    with TestClient(create_app(service, title="traind-test")) as c:
        log_in(c)  # a browser session: what the forms and the live feed need
        yield c


@pytest.fixture
def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def body(**changes: Any) -> dict[str, Any]:
    b: dict[str, Any] = {
        "name": "tune-small", "precisions": ["fp32", "bf16", "fp8"],
        "compressions": [{"method": "none"}, {"method": "powersgd", "powersgd_rank": 4}],
        "steps": 100, "max_rounds": 2, "overrides": {"model.n_layers": 2}, "target_run_id": 3,
    }
    return {**b, **changes}


def csrf(client: TestClient) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/experiments").text)
    assert m
    return m.group(1)


def tune_form(token: str | None, **changes: Any) -> dict[str, Any]:
    f: dict[str, Any] = {"name": "from-the-form", "precision": ["fp32", "bf16"],
                         "method": ["int8", "powersgd"], "steps": "150", "max_rounds": "2",
                         "target_run": "3"}
    if token is not None:
        f["csrf_token"] = token
    return {**f, **changes}


def section(html: str, ident: str) -> str:
    """The markup of the element with this id, up to the end of its section."""
    return html.split(f'id="{ident}"')[1].split("</section>")[0]


# --- JSON API: searches -----------------------------------------------------------------------


def test_submit_returns_201_with_the_search(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    r = client.post("/api/autotunes", json=body(), headers=auth)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["id"] == 1 and out["state"] == "running" and out["target_run_id"] == 3
    assert out["infeasible"][0]["candidate"] == "fp8.none"
    assert out["rounds"][0]["verdicts"] is None
    spec = service.tune_specs[0]
    assert spec.precisions == ("fp32", "bf16", "fp8") and spec.steps == 100
    assert spec.compressions == ({"method": "none"}, {"method": "powersgd", "powersgd_rank": 4})
    assert spec.max_rounds == 2 and spec.overrides == {"model.n_layers": 2}


def test_defaults_are_the_daemons(client: TestClient, service: Any, auth: dict[str, str]) -> None:
    assert client.post("/api/autotunes", json={"name": "d"}, headers=auth).status_code == 201
    spec = service.tune_specs[0]
    assert spec.precisions == ("fp32", "bf16") and spec.steps == 400 and spec.max_rounds == 3
    assert (spec.quality_steps, spec.quality_repeats) == (100, 4)
    assert spec.compressions == ({"method": "none"}, {"method": "int8"})
    assert spec.target_run_id is None and spec.bucket_mb == () and not spec.mesh
    assert client.post("/api/autotunes", json=body(mesh=True), headers=auth).status_code == 201
    assert service.tune_specs[1].mesh


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
@pytest.mark.parametrize(("path", "payload"), [
    ("/api/autotunes", body()), ("/api/autotunes/1/cancel", None),
    ("/api/queue/reorder", {"trial_ids": [23, 21]}),
])
def test_every_post_needs_the_token(
    client: TestClient, service: Any, auth: dict[str, str], make_trials: Any,
    headers: dict[str, str], path: str, payload: Any,
) -> None:
    client.post("/api/autotunes", json=body(), headers=auth)
    service.tune_specs.clear()
    service.trials = make_trials()
    r = client.post(path, json=payload, headers=headers)
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["detail"]
    assert service.tune_specs == [] and service.autotune(1).state == "running"
    assert [t.id for t in service.trials] == [21, 22, 23]


def test_bad_fields_are_a_422_naming_each(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    bad = body(precisions=["fp32", "fp9"], compressions=[{"rank": 4}], steps=0, colour="red")
    r = client.post("/api/autotunes", json=bad, headers=auth)
    assert r.status_code == 422
    locs = {tuple(d["loc"]) for d in r.json()["detail"]}
    assert {("body", "precisions", 1), ("body", "compressions", 0, "method"),
            ("body", "steps"), ("body", "colour")} <= locs
    assert service.tune_specs == [] and client.get("/api/autotunes").json() == []


def test_daemon_errors_name_the_field_and_the_candidate(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    service.tune_reject = ConfigError([
        (("fp32.powersgd-rank0", "compression", "powersgd_rank"),
         "Input should be greater than 0 (got 0)"),
        (("target_run_id",), "run 3 is not running on this node")])
    r = client.post("/api/autotunes", json=body(), headers=auth)
    assert r.status_code == 422
    assert r.json()["detail"] == [
        {"loc": ["body", "fp32.powersgd-rank0", "compression", "powersgd_rank"],
         "msg": "Input should be greater than 0 (got 0)", "type": "value_error"},
        {"loc": ["body", "target_run_id"], "msg": "run 3 is not running on this node",
         "type": "value_error"},
    ]
    assert service.tune_specs == [] and service.autotunes() == []


def test_list_show_and_404(
    client: TestClient, service: Any, auth: dict[str, str], make_autotune: Any
) -> None:
    service.autotune_infos[7] = make_autotune()
    client.post("/api/autotunes", json=body(name="second"), headers=auth)
    assert [t["id"] for t in client.get("/api/autotunes").json()] == [8, 7]
    r = client.get("/api/autotunes/7")
    assert r.status_code == 200
    t = r.json()
    assert t["best"] == {"precision": "bf16", "compression": {"method": "int8"}, "bucket_mb": None}
    assert t["rounds"][2]["verdicts"]["bf16.int8"]["ratio"] == 1.183
    assert t["rounds"][1]["phase"] == "quality"
    assert datetime.fromisoformat(t["created_at"]).tzinfo is not None
    missing = client.get("/api/autotunes/99")
    assert missing.status_code == 404 and "99" in missing.json()["detail"]


def test_cancel_then_409_once_ended(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    client.post("/api/autotunes", json=body(), headers=auth)
    r = client.post("/api/autotunes/1/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    again = client.post("/api/autotunes/1/cancel", headers=auth)
    assert again.status_code == 409 and "already ended" in again.json()["detail"]
    assert client.post("/api/autotunes/5/cancel", headers=auth).status_code == 404


# --- JSON API: promotions and the queue -------------------------------------------------------


def test_promotions_of_one_run_or_all(
    client: TestClient, service: Any, make_promotions: Any
) -> None:
    service.promotion_views = [*make_promotions(3), *make_promotions(9)]
    assert len(client.get("/api/promotions").json()) == 4
    mine = client.get("/api/promotions", params={"run_id": 3}).json()
    assert [p["state"] for p in mine] == ["kept", "rolled_back"]
    assert mine[0]["setting"] == {"precision": "bf16", "compression": {"method": "int8"}}
    assert mine[1]["reason"].startswith("loss spike") and mine[0]["applied_step"] == 1400
    assert client.get("/api/promotions", params={"run_id": "x"}).status_code == 422


def test_queue_lists_and_reorders(
    client: TestClient, service: Any, auth: dict[str, str], make_trials: Any
) -> None:
    service.trials = make_trials()
    assert [t["id"] for t in client.get("/api/queue").json()] == [21, 22, 23]
    r = client.post("/api/queue/reorder", json={"trial_ids": [23, 21]}, headers=auth)
    assert r.status_code == 200 and [t["id"] for t in r.json()] == [23, 22, 21]
    assert r.json()[0] == {"id": 23, "experiment_id": 5, "experiment": "forked-bf16",
                           "arm": "fp32", "repeat": 1, "priority": 23}


@pytest.mark.parametrize(("payload", "loc"), [
    ({"trial_ids": [21, 99]}, ["body", "trial_ids"]),
    ({"trial_ids": [21, 21]}, ["body", "trial_ids"]),
    ({"trial_ids": []}, ["body", "trial_ids"]),
    ({"trial_ids": ["a"]}, ["body", "trial_ids", 0]),
    ({"ids": [21]}, ["body", "trial_ids"]),
])
def test_reorder_422_changes_nothing(
    client: TestClient, service: Any, auth: dict[str, str], make_trials: Any,
    payload: dict[str, Any], loc: list[Any],
) -> None:
    service.trials = make_trials()
    r = client.post("/api/queue/reorder", json=payload, headers=auth)
    assert r.status_code == 422
    assert loc in [d["loc"] for d in r.json()["detail"]]
    assert [t.id for t in service.trials] == [21, 22, 23]


def test_openapi_documents_the_new_routes(client: TestClient) -> None:
    paths = client.get("/api/openapi.json").json()["paths"]
    assert {"/api/autotunes", "/api/autotunes/{tune_id}", "/api/autotunes/{tune_id}/cancel",
            "/api/promotions", "/api/queue", "/api/queue/reorder"} <= set(paths)
    post = paths["/api/autotunes"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AutotuneIn")
    assert {"201", "401", "422"} <= set(post["responses"])
    for path in ("/api/autotunes", "/api/autotunes/{tune_id}/cancel", "/api/queue/reorder"):
        assert paths[path]["post"]["security"] == [{"HTTPBearer": []}], path
    ok = paths["/api/queue"]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["items"]["$ref"].endswith("/QueuedTrialOut")
    assert "/autotunes" not in paths and "/queue/reorder" not in paths


# --- the auto-tune form -----------------------------------------------------------------------


def test_form_success_redirects_to_the_search(client: TestClient, service: Any) -> None:
    r = client.post("/autotunes", data=tune_form(csrf(client)), follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/autotunes/1"
    spec = service.tune_specs[0]
    assert spec.name == "from-the-form" and spec.precisions == ("fp32", "bf16")
    assert spec.compressions == ({"method": "none"}, {"method": "int8"},
                                 {"method": "powersgd"})
    assert spec.steps == 150 and spec.max_rounds == 2 and spec.target_run_id == 3


def test_form_turns_the_mesh_dimension_on(client: TestClient, service: Any) -> None:
    tune = section(client.get("/experiments").text, "auto-tune")
    assert re.search(r'name="mesh" value="on"\s*>', tune)  # offered, off by default
    client.post("/autotunes", data=tune_form(csrf(client)), follow_redirects=False)
    client.post("/autotunes", data=tune_form(csrf(client), mesh="on"), follow_redirects=False)
    assert [s.mesh for s in service.tune_specs] == [False, True]
    # a shape the daemon could not configure is shown beside the box, named
    service.tune_reject = ConfigError.at(("parallel", "tp"), "2 must divide model.n_heads (3)"
                                         ).within("fp32.none.tp2")
    r = client.post("/autotunes", data=tune_form(csrf(client), mesh="on"))
    box = section(r.text, "auto-tune").split('id="tune-mesh"')[1].split("</fieldset>")[0]
    assert "fp32.none.tp2.parallel.tp: 2 must divide" in box
    assert re.search(r'name="mesh" value="on"\s+checked', box)  # kept ticked


def test_form_without_a_target_run(client: TestClient, service: Any) -> None:
    r = client.post("/autotunes", data=tune_form(csrf(client), target_run=""),
                    follow_redirects=False, headers={"Origin": "http://testserver"})
    assert r.status_code == 303 and service.tune_specs[0].target_run_id is None


@pytest.mark.parametrize("token", [None, "forged"])
def test_form_without_the_csrf_token_is_403(
    client: TestClient, service: Any, token: str | None
) -> None:
    r = client.post("/autotunes", data=tune_form(token), follow_redirects=False)
    assert r.status_code == 403 and "CSRF" in r.json()["detail"]
    assert service.tune_specs == []


def test_cross_origin_form_post_is_403(client: TestClient, service: Any) -> None:
    r = client.post("/autotunes", data=tune_form(csrf(client)), follow_redirects=False,
                    headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["detail"]
    assert service.tune_specs == []


def test_form_errors_are_shown_beside_their_fields(client: TestClient, service: Any) -> None:
    r = client.post("/autotunes", data=tune_form(csrf(client), precision=[], steps="0", name=""))
    assert r.status_code == 422
    tune = section(r.text, "auto-tune")
    assert re.search(r'name="steps"[^>]*aria-invalid="true"', tune)
    assert re.search(r'name="name"[^>]*aria-invalid="true"', tune)
    precisions = tune.split('id="tune-precisions"')[1].split("</fieldset>")[0]
    assert 'aria-invalid="true"' in precisions and "at least 1 item" in precisions
    assert re.search(r'value="powersgd"\s+checked', tune)  # what was ticked is kept
    # The experiment form above it is untouched.
    assert 'aria-invalid' not in section(r.text, "new-experiment")
    assert service.tune_specs == []


def test_form_shows_the_daemons_errors_beside_the_boxes(
    client: TestClient, service: Any
) -> None:
    service.tune_reject = ConfigError([
        (("fp32.powersgd", "compression", "powersgd_rank"), "must be >= 1"),
        (("target_run_id",), "run 3 is not running on this node"),
        (("precision",), "the job's own 'fp16' cannot be the tuner's baseline")])
    r = client.post("/autotunes", data=tune_form(csrf(client)))
    assert r.status_code == 422
    tune = section(r.text, "auto-tune")
    methods = tune.split('id="tune-methods"')[1].split("</fieldset>")[0]
    assert "fp32.powersgd.compression.powersgd_rank: must be &gt;= 1" in methods
    target = tune.split('name="target_run"')[1].split("</label>")[0]
    assert "run 3 is not running on this node" in target
    assert 'class="form-errors"' in tune and "precision: the job&#39;s own" in tune
    assert service.tune_specs == []


def test_cancel_form(client: TestClient, service: Any, auth: dict[str, str]) -> None:
    client.post("/api/autotunes", json=body(), headers=auth)
    assert client.post("/autotunes/1/cancel", data={}).status_code == 403
    r = client.post("/autotunes/1/cancel", data={"csrf_token": csrf(client)},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/autotunes/1"
    assert service.autotune(1).state == "cancelled"


# --- the queue on /experiments ----------------------------------------------------------------


def test_queue_section_offers_up_down_and_no_cancel_per_trial(
    client: TestClient, service: Any, make_trials: Any
) -> None:
    assert "No trials waiting" in client.get("/experiments").text
    service.trials = make_trials()
    queue = section(client.get("/experiments").text, "queue")
    rows = queue.split('id="trial-')[1:]
    assert [r.split('"')[0] for r in rows] == ["21", "22", "23"]
    first, middle, last = rows

    def orders(row: str, move: str) -> list[list[str]]:
        return [re.findall(r'name="trial_ids" value="(\d+)"', f)
                for f in row.split("<form")[1:] if f'value="{move}"' in f]

    # Each button names its pair in the new order; the daemon swaps their slots.
    assert orders(first, "up") == [] and orders(first, "down") == [["22", "21"]]
    assert orders(middle, "up") == [["22", "21"]]
    assert orders(middle, "down") == [["23", "22"]]
    assert orders(last, "up") == [["23", "22"]] and orders(last, "down") == []
    assert 'name="csrf_token"' in first
    # A trial is cancelled with its experiment: one button per experiment (in the
    # experiments table and on its page), none on each of its trials' rows.
    assert "/cancel" not in queue and 'href="/experiments/5"' in first


def test_reorder_through_the_form(client: TestClient, service: Any, make_trials: Any) -> None:
    service.trials = make_trials()
    token = csrf(client)
    assert client.post("/queue/reorder", data={"trial_ids": ["22", "21", "23"]},
                       follow_redirects=False).status_code == 403
    cross = client.post("/queue/reorder", data={"csrf_token": token, "trial_ids": ["22", "21"]},
                        headers={"Origin": "http://evil.example"}, follow_redirects=False)
    assert cross.status_code == 403 and [t.id for t in service.trials] == [21, 22, 23]
    r = client.post("/queue/reorder", data={"csrf_token": token, "trial_ids": ["22", "21", "23"]},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/experiments#queue"
    assert [t.id for t in service.trials] == [22, 21, 23]
    # A button's pair: the last one up, past 21; 22 keeps its place.
    r = client.post("/queue/reorder", data={"csrf_token": token, "trial_ids": ["23", "21"]},
                    follow_redirects=False)
    assert r.status_code == 303 and [t.id for t in service.trials] == [22, 23, 21]


def test_a_stale_reorder_says_why_and_changes_nothing(
    client: TestClient, service: Any, make_trials: Any
) -> None:
    service.trials = make_trials()
    r = client.post("/queue/reorder", data={"csrf_token": csrf(client),
                                            "trial_ids": ["22", "20", "21"]})
    assert r.status_code == 422
    queue = section(r.text, "queue")
    assert "not waiting trials: [20]" in queue and 'role="alert"' in queue
    assert [t.id for t in service.trials] == [21, 22, 23]
    bad = client.post("/queue/reorder", data={"csrf_token": csrf(client), "trial_ids": ["x"]})
    assert bad.status_code == 422 and "trial_ids" in section(bad.text, "queue")


# --- pages ------------------------------------------------------------------------------------


def test_experiments_page_offers_the_tune_form_and_lists_searches(
    client: TestClient, service: Any, make_autotune: Any
) -> None:
    text = client.get("/experiments").text
    tune = section(text, "auto-tune")
    assert 'action="/autotunes"' in tune and 'name="csrf_token"' in tune
    for p in ("fp32", "bf16", "fp16", "fp8"):
        assert f'name="precision" value="{p}"' in tune
    for m in ("none", "fp16", "bf16", "int8", "topk", "powersgd"):
        assert f'name="method" value="{m}"' in tune
    # Only running runs can take a promotion (run 3 of the sample runs).
    assert '<option value="3"' in tune and '<option value="2"' not in tune
    assert "No searches yet" in text
    service.autotune_infos[7] = make_autotune()
    listed = section(client.get("/experiments").text, "autotunes")
    assert 'href="/autotunes/7"' in listed and "bf16 \u00b7 int8" in listed
    assert 'badge-done' in listed


def test_autotune_page_shows_rounds_left_out_and_promotions(
    client: TestClient, service: Any, make_autotune: Any, make_promotions: Any
) -> None:
    service.autotune_infos[7] = make_autotune()
    service.promotion_views = [*make_promotions(3), *make_promotions(9)]
    r = client.get("/autotunes/7")
    assert r.status_code == 200
    text = r.text
    assert 'http-equiv="refresh"' not in text and "/autotunes/7/cancel" not in text
    assert section(text, "best").startswith('>bf16 \u00b7 int8<')
    rounds = text.split('id="rounds"')[1].split("</section>")[0]
    assert rounds.count('class="round"') == 4
    first, quality, second, third = rounds.split('class="round"')[1:]
    assert "speed \u00b7 interleaved" in first and "quality \u00b7 forked" in quality
    assert "quality: non-inferior" in quality and "quality:" not in first
    assert 'href="/experiments/14"' in quality
    assert "precision" in first and "fp32 \u00b7 none" in first
    assert "1.412\u00d7" in first and "1.351 \u2013 1.476" in first
    assert 'href="/experiments/11"' in first and "badge-completed" in first
    assert "bf16 \u00b7 powersgd (rank 4)" in second
    assert "inconclusive (budget spent)" in second and "rejected (quality)" in second
    assert "loss 9% worse than bf16.none" in second
    assert "failed (error)" in third and "gave no verdict" in third
    left = section(text, "infeasible")
    assert "fp8.none" in left and "compute capability 8.9+" in left
    promos = section(text, "promotions")
    assert promos.count('id="promotion-') == 2  # run 3's only
    assert "kept" in promos and "fp32 \u00b7 none" in promos and "1,400" in promos
    assert "loss spike: 7.9 against a median of 3.2" in promos
    assert "topk (ratio 0.01)" in promos


def test_a_running_search_reloads_itself_and_can_be_cancelled(
    client: TestClient, auth: dict[str, str]
) -> None:
    client.post("/api/autotunes", json=body(target_run_id=None), headers=auth)
    text = client.get("/autotunes/1").text
    assert 'http-equiv="refresh"' in text and 'action="/autotunes/1/cancel"' in text
    rounds = section(text, "rounds")
    assert "running" in rounds and 'href="/experiments/41"' in rounds
    assert 'id="promotions"' not in text and "fp8.none" in section(text, "infeasible")


def test_missing_autotune_page_is_404(client: TestClient) -> None:
    assert client.get("/autotunes/42").status_code == 404


def test_runs_page_shows_each_runs_promotions(
    client: TestClient, service: Any, make_promotions: Any
) -> None:
    service.promotion_views = make_promotions(3)
    text = client.get("/runs").text
    run3 = text.split('id="run-3"')[1].split("</tbody>")[0]
    assert run3.count("promotion-row") == 2
    assert "promotion kept" in run3 and "applied at step 1,400" in run3
    assert 'href="/autotunes/7"' in run3 and "loss spike: 7.9" in run3
    assert "promotion-row" not in text.split('id="run-2"')[1]


def test_a_search_nothing_beat_says_so_and_its_row_sent_nothing(
    client: TestClient, service: Any, make_autotune: Any, make_promotions: Any
) -> None:
    import dataclasses

    info = make_autotune()
    best = {**info.best, "nothing_beat_baseline": True}
    service.autotune_infos[7] = dataclasses.replace(info, best=best)
    kept, _ = make_promotions(3)
    service.promotion_views = [dataclasses.replace(
        kept, seq=None, state="unchanged", applied_step=None,
        reason="nothing beat the baseline (fp32 \u00b7 none) in 2 rounds: no setting sent",
        config_hash="ab" * 32, versions={"traind": "0.1", "torch": "2.13", "device": "cpu"})]
    text = client.get("/autotunes/7").text
    assert "(nothing beat the baseline)" in section(text, "best")
    promos = section(text, "promotions")
    assert "badge-cancelled" in promos and ">unchanged<" in promos
    assert "no setting sent" in promos and "job config abababab" in promos
    (out,) = client.get("/api/promotions", params={"run_id": 3}).json()
    assert out["seq"] is None and out["state"] == "unchanged"
    assert out["config_hash"] == "ab" * 32 and out["evidence_config_hash"] is None
