"""Experiments through the JSON API and the form, against the fake service: the token, the
422s that name fields (with nothing queued), CSRF and Origin on the form, and the pages."""

from __future__ import annotations

import csv
import html
import io
import json
import re
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient

from tests.web.conftest import log_in
from traind.daemon.config import ConfigError, validate
from traind.trainer.config import TrainConfig
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
        "name": "int8-vs-none", "steps": 400, "block_steps": 20,
        "overrides": {"model.n_layers": 2},
        "arms": [{"name": "none"}, {"name": "int8", "compression": {"method": "int8"}}],
    }
    return {**b, **changes}


def config_error(tree: dict[str, Any]) -> ConfigError:
    """The daemon's own error for validating ``tree`` as a job config."""
    with pytest.raises(ConfigError) as exc:
        validate(tree, TrainConfig)
    return exc.value


def csrf(client: TestClient) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/experiments").text)
    assert m
    return m.group(1)


def form(token: str | None, **changes: str) -> dict[str, str]:
    f = {"name": "from-the-form", "steps": "200", "block_steps": "10",
         "arm0_name": "", "arm0_method": "none", "arm0_precision": "",
         "arm1_name": "", "arm1_method": "powersgd", "arm1_precision": "bf16"}
    if token is not None:
        f["csrf_token"] = token
    return {**f, **changes}


# --- JSON API ---------------------------------------------------------------------------------


def test_submit_returns_201_with_the_experiment(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    r = client.post("/api/experiments", json=body(), headers=auth)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["id"] == 1 and out["state"] == "queued" and out["arms"] == ["none", "int8"]
    assert datetime.fromisoformat(out["created_at"]).tzinfo is not None
    spec = service.specs[0]
    assert spec.steps == 400 and spec.overrides == {"model.n_layers": 2}
    assert spec.arms[1] == {"name": "int8", "compression": {"method": "int8"}, "precision": None}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic dXNlcjpwYXNz"}])
def test_submit_needs_the_token(
    client: TestClient, service: Any, headers: dict[str, str]
) -> None:
    r = client.post("/api/experiments", json=body(), headers=headers)
    assert r.status_code == 401
    assert "Authorization: Bearer" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert service.specs == []


def test_one_arm_is_a_422_naming_arms(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    r = client.post("/api/experiments", json=body(arms=[{"name": "solo"}]), headers=auth)
    assert r.status_code == 422
    assert [d["loc"] for d in r.json()["detail"]] == [["body", "arms"]]
    assert service.specs == [] and client.get("/api/experiments").json() == []


def test_bad_precision_and_unknown_key_are_named(client: TestClient, auth: dict[str, str]) -> None:
    arms = [{"name": "a"}, {"name": "b", "precision": "fp8"}]
    r = client.post("/api/experiments", json=body(arms=arms, stepz=3), headers=auth)
    locs = {tuple(d["loc"]) for d in r.json()["detail"]}
    assert r.status_code == 422
    assert ("body", "arms", 1, "precision") in locs and ("body", "stepz") in locs


def test_service_value_error_is_a_422_naming_the_daemon_fields(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    service.reject = ConfigError([
        (("interleave", "arms", 1, "compression"), "unknown method 'int9'"),
        (("job", "steps"), "Input should be greater than 0 (got 0)")])
    r = client.post("/api/experiments", json=body(), headers=auth)
    assert r.status_code == 422
    assert r.json()["detail"] == [
        {"loc": ["body", "interleave", "arms", 1, "compression"],
         "msg": "unknown method 'int9'", "type": "value_error"},
        {"loc": ["body", "job", "steps"], "msg": "Input should be greater than 0 (got 0)",
         "type": "value_error"},
    ]
    assert service.specs == [] and service.experiments() == []


def test_a_422_carries_each_loc_pydantic_gave(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    # The arm's compression is checked by a model check of the whole tree: its loc travels
    # inside the error, and the text is never read back.
    service.reject = config_error({"interleave": {"arms": [
        {"name": "a"}, {"name": "b", "compression": {"method": "int9"}}]}})
    r = client.post("/api/experiments", json=body(), headers=auth)
    assert r.status_code == 422
    [item] = r.json()["detail"]
    assert item["loc"] == ["body", "interleave", "arms", 1, "compression", "method"]
    assert item["msg"].startswith("Input should be 'none'") and "int9" not in item["loc"]


def test_the_loc_comes_from_the_error_not_its_text(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    service.reject = ConfigError([(("job", "steps"), "too many")], "looks like a: field path")
    r = client.post("/api/experiments", json=body(), headers=auth)
    assert r.json()["detail"] == [{"loc": ["body", "job", "steps"], "msg": "too many",
                                   "type": "value_error"}]


def test_a_message_without_a_field_goes_against_the_body(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    service.reject = "a queue of 3 experiments is full"
    r = client.post("/api/experiments", json=body(), headers=auth)
    assert r.status_code == 422
    assert r.json()["detail"] == [{"loc": ["body"], "msg": "a queue of 3 experiments is full",
                                   "type": "value_error"}]


def test_list_and_show(client: TestClient, auth: dict[str, str]) -> None:
    for name in ("first", "second"):
        client.post("/api/experiments", json=body(name=name), headers=auth)
    assert [e["name"] for e in client.get("/api/experiments").json()] == ["second", "first"]
    r = client.get("/api/experiments/1")
    assert r.status_code == 200 and r.json()["name"] == "first"
    missing = client.get("/api/experiments/99")
    assert missing.status_code == 404 and "99" in missing.json()["detail"]


def test_cancel_needs_the_token_then_409_once_ended(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    assert client.post("/api/experiments/1/cancel").status_code == 401
    assert service.experiment(1).state == "queued"
    r = client.post("/api/experiments/1/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    again = client.post("/api/experiments/1/cancel", headers=auth)
    assert again.status_code == 409 and "already ended" in again.json()["detail"]
    assert client.post("/api/experiments/7/cancel", headers=auth).status_code == 404


def test_export_csv_and_json(
    client: TestClient, service: Any, auth: dict[str, str], make_verdict: Any
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    service.finish(1, make_verdict())
    r = client.get("/api/experiments/1/export", params={"format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert 'filename="experiment-1.csv"' in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert list(rows[0]) == ["arm", "kind", "ratio", "low", "high", "p_value", "reason",
                             "interval"]
    assert rows == [{"arm": "int8", "kind": "better", "ratio": "1.183", "low": "1.121",
                     "high": "1.248", "p_value": "0.0012",
                     "reason": "int8 is 1.183x faster than none (95% CS 1.121-1.248)",
                     "interval": "95% always-valid confidence sequence"}]
    j = client.get("/api/experiments/1/export?format=json").json()
    assert j == [{**rows[0], "ratio": 1.183, "low": 1.121, "high": 1.248, "p_value": 0.0012}]
    assert client.get("/api/experiments/1/export?format=xml").status_code == 422
    assert client.get("/api/experiments/5/export").status_code == 404


def test_export_before_a_verdict_lists_pending_arms(
    client: TestClient, auth: dict[str, str]
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    rows = client.get("/api/experiments/1/export").json()
    assert rows == [{"arm": "int8", "kind": "pending", "ratio": None, "low": None,
                     "high": None, "p_value": None, "reason": "", "interval": ""}]


def test_openapi_documents_the_routes_and_the_bearer_scheme(client: TestClient) -> None:
    doc = client.get("/api/openapi.json").json()
    paths = doc["paths"]
    assert {"/api/experiments", "/api/experiments/{experiment_id}",
            "/api/experiments/{experiment_id}/cancel",
            "/api/experiments/{experiment_id}/export"} <= set(paths)
    post = paths["/api/experiments"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ExperimentIn")
    assert {"201", "401", "422"} <= set(post["responses"])
    assert post["security"] == [{"HTTPBearer": []}]
    assert "/experiments" not in paths  # the HTML form is not part of the API


# --- the form ---------------------------------------------------------------------------------


def test_form_success_redirects_to_the_experiment(client: TestClient, service: Any) -> None:
    r = client.post("/experiments", data=form(csrf(client)), follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/experiments/1"
    spec = service.specs[0]
    assert spec.name == "from-the-form" and spec.steps == 200 and spec.block_steps == 10
    assert spec.arms == (
        {"name": "none", "compression": {"method": "none"}, "precision": None},
        {"name": "powersgd-bf16", "compression": {"method": "powersgd"}, "precision": "bf16"},
    )


def test_form_same_origin_is_accepted(client: TestClient) -> None:
    r = client.post("/experiments", data=form(csrf(client)), follow_redirects=False,
                    headers={"Origin": "http://testserver"})
    assert r.status_code == 303


@pytest.mark.parametrize("token", [None, "forged"])
def test_form_without_the_csrf_token_is_403(
    client: TestClient, service: Any, token: str | None
) -> None:
    r = client.post("/experiments", data=form(token), follow_redirects=False)
    assert r.status_code == 403 and "CSRF" in r.json()["detail"]
    assert service.specs == []


@pytest.mark.parametrize("origin", ["http://evil.example", "null"])
def test_cross_origin_form_post_is_403(client: TestClient, service: Any, origin: str) -> None:
    r = client.post("/experiments", data=form(csrf(client)), follow_redirects=False,
                    headers={"Origin": origin})
    assert r.status_code == 403 and "cross-origin" in r.json()["detail"]
    assert service.specs == []


def test_csrf_token_is_per_session(service: Any) -> None:
    app = create_app(service)
    with TestClient(app) as a, TestClient(app) as b:
        a_csrf, b_csrf = log_in(a).csrf, log_in(b).csrf
        assert a_csrf != b_csrf and csrf(a) == a_csrf
        r = a.post("/experiments", data=form(b_csrf), follow_redirects=False)
        assert r.status_code == 403
        assert a.post("/experiments", data=form(a_csrf),
                      follow_redirects=False).status_code == 303
    with TestClient(create_app(service)) as c:  # another daemon: the session means nothing
        c.cookies.update(a.cookies)
        assert c.post("/experiments", data=form(a_csrf),
                      follow_redirects=False).status_code == 403


def test_form_errors_are_shown_beside_their_fields(client: TestClient, service: Any) -> None:
    r = client.post("/experiments", data=form(csrf(client), steps="0", name=""))
    assert r.status_code == 422
    text = r.text
    assert re.search(r'name="steps"[^>]*aria-invalid="true"', text)
    assert re.search(r'name="name"[^>]*aria-invalid="true"', text)
    assert "greater than 0" in text
    assert 'value="10"' in text  # what was typed is kept
    assert service.specs == []


def test_form_shows_the_daemons_errors(client: TestClient, service: Any) -> None:
    service.reject = ConfigError([
        (("interleave", "arms", 1, "compression", "rank"), "must be >= 1"),
        (("interleave", "block_steps"), "too short for 2 arms"), (("gpu",), "none found")])
    r = client.post("/experiments", data=form(csrf(client)))
    assert r.status_code == 422
    arm1 = r.text.split('id="arm1"')[1].split("</fieldset>")[0]
    assert "must be &gt;= 1" in arm1
    assert re.search(r'name="block_steps"[^>]*aria-invalid="true"', r.text)
    assert 'class="form-errors"' in r.text and "gpu: none found" in r.text
    assert service.specs == []


def test_form_highlights_a_bad_arm_field_from_its_loc(client: TestClient, service: Any) -> None:
    # A real config error of arm B's compression, worded so that no text names the arm: the
    # message lands in arm B's fieldset because its loc says interleave.arms.1.
    found = config_error({"interleave": {"arms": [
        {"name": "a"}, {"name": "b", "compression": {"powersgd_rank": 0}}]}})
    assert found.errors[0][0] == ("interleave", "arms", 1, "compression", "powersgd_rank")
    service.reject = ConfigError(found.errors, "this text names no field")
    r = client.post("/experiments", data=form(csrf(client)))
    assert r.status_code == 422
    arm0, arm1 = (r.text.split(f'id="arm{i}"')[1].split("</fieldset>")[0] for i in (0, 1))
    assert "greater than 0" in arm1 and "greater than 0" not in arm0
    assert 'class="form-errors"' not in r.text and service.specs == []


def test_cancel_form(client: TestClient, service: Any, auth: dict[str, str]) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    assert client.post("/experiments/1/cancel", data={}).status_code == 403
    r = client.post("/experiments/1/cancel", data={"csrf_token": csrf(client)},
                    follow_redirects=False)
    assert r.status_code == 303 and service.experiment(1).state == "cancelled"


# --- pages ------------------------------------------------------------------------------------


def test_experiments_page_lists_and_offers_the_form(
    client: TestClient, service: Any, auth: dict[str, str], make_verdict: Any
) -> None:
    assert "No experiments yet" in client.get("/experiments").text
    client.post("/api/experiments", json=body(), headers=auth)
    service.finish(1, make_verdict())
    r = client.get("/experiments")
    assert r.status_code == 200
    text = r.text
    assert 'href="/experiments" aria-current="page"' in text
    assert 'href="/experiments/1"' in text and "none vs int8" in text
    assert 'class="badge badge-done"' in text and "int8: better" in text
    for method in ("none", "fp16", "bf16", "int8", "topk", "powersgd"):
        assert f'<option value="{method}"' in text
    assert 'name="arm1_precision"' in text and '<option value="bf16"' in text


def test_nav_links_experiments_everywhere(client: TestClient) -> None:
    assert 'href="/experiments"' in client.get("/runs").text


def test_experiment_page_shows_the_verdict_and_chart(
    client: TestClient, service: Any, auth: dict[str, str], make_verdict: Any
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    running = client.get("/experiments/1").text
    assert 'http-equiv="refresh"' in running and "No verdict yet" not in running
    assert 'action="/experiments/1/cancel"' in running
    service.finish(1, make_verdict())
    r = client.get("/experiments/1")
    assert r.status_code == 200
    text = r.text
    assert 'http-equiv="refresh"' not in text and "/experiments/1/cancel" not in text
    assert "1.183\u00d7" in text and "1.121 \u2013 1.248" in text
    assert "int8 is 1.183x faster than none" in text
    assert 'href="/runs/101"' in text
    assert "/api/experiments/1/export?format=csv" in text
    assert "/api/experiments/1/export?format=json" in text
    assert 'id="chart-verdict"' in text and "/static/experiment.js" in text
    data = json.loads(text.split('id="verdict-data">')[1].split("</script>")[0])
    assert data["arms"] == ["int8"] and data["ratio"] == [1.183]
    assert data["plus"][0] == pytest.approx(0.065) and data["minus"][0] == pytest.approx(0.062)
    assert client.get("/static/experiment.js").status_code == 200


def test_missing_experiment_page_is_404(client: TestClient) -> None:
    assert client.get("/experiments/42").status_code == 404


# --- the verdict's settings -------------------------------------------------------------------


def test_the_bands_travel_from_the_api_and_the_form_to_the_spec(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    r = client.post("/api/experiments", json=body(min_effect=0.05, equivalence=0.03),
                    headers=auth)
    assert r.status_code == 201, r.text
    assert (service.specs[0].min_effect, service.specs[0].equivalence) == (0.05, 0.03)
    r = client.post("/api/experiments", json=body(), headers=auth)  # the defaults
    # no band: the daemon chooses it from the budget and its noise (daemon/experiments/bands)
    assert (service.specs[1].min_effect, service.specs[1].equivalence) == (0.02, None)
    r = client.post("/experiments", data=form(csrf(client), min_effect="0.1",
                                              equivalence="0.015"), follow_redirects=False)
    assert r.status_code == 303
    assert (service.specs[2].min_effect, service.specs[2].equivalence) == (0.1, 0.015)


@pytest.mark.parametrize("field", ["min_effect", "equivalence"])
def test_a_band_outside_0_to_1_is_a_422_naming_it(
    client: TestClient, service: Any, auth: dict[str, str], field: str
) -> None:
    for bad in (0, 1, -0.1):
        r = client.post("/api/experiments", json=body(**{field: bad}), headers=auth)
        assert r.status_code == 422 and [d["loc"] for d in r.json()["detail"]] == [
            ["body", field]], r.text
    r = client.post("/experiments", data=form(csrf(client), **{field: "0"}))
    assert r.status_code == 422
    assert re.search(rf'name="{field}"[^>]*aria-invalid="true"', r.text)
    assert service.specs == []


def test_the_schema_says_the_loss_margin_is_absolute_nats(client: TestClient) -> None:
    props = client.get("/api/openapi.json").json()["components"]["schemas"]["ExperimentIn"][
        "properties"]
    assert "nats" in props["loss_margin"]["description"]
    assert "relative" in props["equivalence"]["description"]


def test_the_form_says_what_the_band_costs_at_this_nodes_noise(
    client: TestClient, service: Any
) -> None:
    import asyncio
    import concurrent.futures
    from dataclasses import replace

    from traind.daemon.experiments.stats import DEFAULT_PAIR_NOISE, reachable_band
    from traind.daemon.service import ExperimentSpec

    def note(page: str) -> str:
        m = re.search(r'id="band-cost">([^<]+)<', page)
        assert m, "no band note shown"
        return html.unescape(m.group(1))

    # the form leaves the band to the node (auto): it says what that will be at its budget
    # (1,200 steps of 2 arms in blocks of 20: 30 pairs), at the assumed noise until one is
    # measured
    auto = reachable_band(DEFAULT_PAIR_NOISE, 30)
    assert note(client.get("/experiments").text) == (
        f"auto at this budget: \u00b1{round(auto * 100, 1):g}%, the band an A/A reaches in 30 "
        "pairs at 8% per pair (assumed: this node has measured none yet)")

    # In a thread of its own: a browser test earlier in the session may leave an event loop
    # running in this one, and asyncio.run refuses to nest.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        info = pool.submit(asyncio.run, service.submit_experiment(ExperimentSpec(
            name="aa", steps=800, arms=({"name": "a"}, {"name": "b"})))).result()
    service.experiment_infos[info.id] = replace(
        info, state="done", verdict={"b": {"kind": "no difference", "noise": 0.041,
                                           "pairs": 20}})
    auto = reachable_band(0.041, 30)
    assert note(client.get("/experiments").text) == (
        f"auto at this budget: \u00b1{round(auto * 100, 1):g}%, the band an A/A reaches in 30 "
        f"pairs at 4.1% per pair, measured over 20 pairs by experiment {info.id}")
    # a band typed in (the form shown again with an error elsewhere): what it costs here
    page = client.post("/experiments", data=form(csrf(client), name="", equivalence="0.02",
                                                 block_steps="20")).text
    assert note(page) == (
        f"at this node's noise (4.1% per pair, measured over 20 pairs by experiment "
        f"{info.id}) \u00b12% needs about 47 pairs (1,880 steps)")


def test_the_experiment_page_says_when_an_arm_was_decided(
    client: TestClient, service: Any, auth: dict[str, str], make_verdict: Any
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    verdict = make_verdict()
    verdict["int8"] = {**verdict["int8"], "decided_at_step": 320, "budget_steps": 4000}
    service.finish(1, verdict)
    assert re.search(r'class="num decided">step 320 of 4,000<', client.get("/experiments/1").text)


def test_the_experiment_page_and_the_api_say_which_band_and_how_it_was_chosen(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    from dataclasses import replace

    client.post("/api/experiments", json=body(), headers=auth)
    rule = "auto: the band an A/A reaches in 10 pairs at 6.1% per pair, measured by experiment 3"
    service.experiment_infos[1] = replace(service.experiment_infos[1], equivalence=0.11,
                                          equivalence_rule=rule)
    m = re.search(r'<dd id="band">([^<]+)</dd>', client.get("/experiments/1").text)
    assert m and html.unescape(m.group(1)) == f"\u00b111% ({rule})"
    got = client.get("/api/experiments/1").json()
    assert (got["equivalence"], got["equivalence_rule"]) == (0.11, rule)
    service.experiment_infos[1] = replace(service.experiment_infos[1], equivalence_rule=None)
    assert "\u00b111% (set by the submission)" in html.unescape(
        client.get("/experiments/1").text)


# --- what a verdict rests on: its words, its test, each arm's means, its progress -----------


def abba_blocks(arms: tuple[str, ...], rounds: int, tps: dict[str, float]) -> list[Any]:
    """Complete ABBA rounds of blocks of 20 steps, each arm at its throughput."""
    from traind.daemon.service import Measurement

    out, i = [], 0
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            out.append(Measurement(arm, i, 20 * (i + 1), tps[arm] * (1 + 0.01 * (i % 3)),
                                   2.5 - 0.01 * i))
            i += 1
    return out


def test_a_running_experiment_shows_its_progress_means_and_blocks(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    from dataclasses import replace

    client.post("/api/experiments", json=body(), headers=auth)
    info = service.experiment_infos[1]
    service.experiment_infos[1] = replace(info, state="running", verdict={"int8": {
        "kind": "running", "pairs": 12, "ratio": 1.2, "low": 0.98, "high": 1.45,
        "p_value": 0.13, "interval": "95% always-valid confidence sequence",
        "reason": "int8: 1.200x so far (12 pairs, always-valid p 0.13)"}})
    service.measurements[1] = abba_blocks(("none", "int8"), 12, {"none": 1000.0, "int8": 1200.0})
    text = client.get("/experiments/1").text
    # Progress: complete pairs of the 30 the budget holds, and the step.
    m = re.search(r'<dd id="progress"><progress max="100" value="([\d.]+)"></progress> ([^<]+)',
                  text)
    assert m and float(m.group(1)) == 40.0
    assert html.unescape(m.group(2)) == "12 of 30 pairs \u00b7 step 480 of 1,200"
    # One interval, from the same test as the p beside it, named once.
    note = html.unescape(text.split('id="interval-note">')[1].split("</p>")[0])
    assert note.startswith("Interval: 95% always-valid confidence sequence; p: the always-valid")
    # Each arm's means as columns; the throughput means divide to the ratio.
    means = text.split('id="arm-means"')[1].split("</section>")[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)
            for r in means.split('<tr id="mean-')[1:]]
    assert [html.unescape(c[1]) for c in rows] == ["12", "12"]
    assert html.unescape(rows[1][3]) == "1.200\u00d7" and html.unescape(rows[0][3]) == "1.000\u00d7"
    # Each arm's throughput per block, a line each.
    data = json.loads(text.split('id="blocks-data">')[1].split("</script>")[0])
    assert [t["name"] for t in data["traces"]] == ["none (baseline)", "int8"]
    assert data["x_title"] == "block" and len(data["traces"][1]["y"]) == 12
    assert data["traces"][0]["x"][:4] == [0, 3, 4, 7]  # ABBA: none runs blocks 0, 3, 4, 7


def test_verdict_words_separate_worse_from_needs_more_steps(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)

    def shown(kind: str, quality: dict[str, Any] | None = None) -> tuple[str, str]:
        service.finish(1, {"int8": {"kind": kind, "ratio": 0.9, "low": 0.85, "high": 0.95,
                                    "p_value": 0.01, "reason": "r", "quality": quality}})
        row = client.get("/experiments/1").text.split('id="verdict-0"')[1]
        badge = re.search(r'data-kind="([^"]+)"[^>]*>([^<]+)<', row)
        assert badge and html.unescape(badge.group(1)) == kind
        q = re.search(r'<td class="quality">([^<]*)<', row)
        assert q
        return html.unescape(badge.group(2)), html.unescape(q.group(1))

    assert shown("worse")[0] == "worse: shown slower"
    assert shown("worse")[1] == "not checked"
    words, quality = shown("not shown (budget spent)", {"measure": "validation loss",
                                                         "status": "not shown"})
    assert words == "faster, quality not shown non-inferior: needs more steps"
    assert quality == "validation loss: not shown non-inferior (needs more steps)"
    assert shown("inconclusive (budget spent)")[0] == "inconclusive: needs more steps"
    assert shown("rejected (quality)", {"measure": "loss (shared weights)",
                                        "status": "harm"})[1] == (
        "loss (shared weights): worse by more than the margin (harm shown)")


def test_a_forked_experiment_shows_trials_done_and_their_means(
    client: TestClient, service: Any, auth: dict[str, str]
) -> None:
    from dataclasses import replace

    from traind.daemon.service import Measurement

    client.post("/api/experiments", json=body(), headers=auth)
    service.experiment_infos[1] = replace(service.experiment_infos[1], mode="forked",
                                          state="running", verdict=None)
    service.measurements[1] = [
        Measurement("none", 0, None, 1000.0, 2.4, "done", 11),
        Measurement("int8", 0, None, 1100.0, 2.5, "done", 12),
        Measurement("int8", 1, None, None, None, "running"),
        Measurement("none", 1, None, None, None, "waiting")]
    text = client.get("/experiments/1").text
    assert "2 of 4 trials" in html.unescape(text.split('id="progress">')[1].split("</dd>")[0])
    assert "Val loss" in text and "Trials" in text
    data = json.loads(text.split('id="blocks-data">')[1].split("</script>")[0])
    assert data["x_title"] == "repeat" and data["traces"][1]["x"] == [1]
    note = html.unescape(text.split('id="interval-note">')[1].split("</p>")[0])
    assert note.startswith("Interval: 95% t interval; p: the same test's, read once")


def test_one_cancel_per_experiment_and_each_asks_first(
    client: TestClient, service: Any, auth: dict[str, str], make_verdict: Any
) -> None:
    client.post("/api/experiments", json=body(), headers=auth)
    client.post("/api/experiments", json=body(name="second"), headers=auth)
    service.finish(2, make_verdict())
    log_in(client)
    listing = client.get("/experiments").text
    rows = {i: listing.split(f'id="experiment-{i}"')[1].split("</tbody>")[0] for i in (1, 2)}
    assert rows[1].count('action="/experiments/1/cancel"') == 1
    assert "data-confirm=" in rows[1] and "/cancel" not in rows[2]  # ended: nothing to cancel
    page = client.get("/experiments/1").text
    assert page.count("/experiments/1/cancel") == 1
    assert re.search(r'id="cancel-form"\s+data-confirm="Cancel experiment 1', page)
    assert '<script src="/static/confirm.js">' in page
    assert client.get("/static/confirm.js").status_code == 200
