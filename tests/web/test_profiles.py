"""Profiles on demand through the API and the pages, against the fake service: who may ask,
what is refused and how, the report page before and after its report, and downloads by
number only. The real job, daemon and browser: tests/e2e/test_browser_profile.py."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest

from tests.daemon.test_profile_analysis import host_trace
from traind.daemon.profiles.analysis import report
from traind.web.profileviews import profile_fields

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi.testclient import TestClient

@pytest.fixture
def client(session_client: TestClient) -> TestClient:
    return session_client


def _ready(service: Any, tmp_path: Path, run: int = 3) -> None:
    """Capture 1 of ``run`` built from two ranks' traces, its files on disk."""
    c, _ = service.captures[run][0]
    traces = {0: host_trace(), 1: host_trace(base_ns=10**12 + 400_000)}
    body = report(traces, {}) | {"trace_bytes": {"0": 1234, "1": 1300},
                                 "analysis_seconds": 0.2}
    service.captures[run][0] = (replace(c, state="ready", traces=(0, 1)), body)
    for rank, trace in traces.items():
        path = tmp_path / f"rank{rank}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(trace).encode()))
        service.trace_files[(run, 1, rank)] = path


def test_asking_needs_the_token_and_valid_fields(client: TestClient, auth: dict[str, str],
                                                 service: Any) -> None:
    assert client.post("/api/runs/3/profile", json={"steps": 3}).status_code == 401
    for body, field in (({"steps": 0}, "steps"), ({"steps": 51}, "steps"),
                        ({"steps": "3"}, "steps"), ({"steps": 3, "ranks": [-1]}, "ranks"),
                        ({"steps": 3, "ranks": []}, "ranks"),
                        ({"steps": 3, "path": "/etc"}, "path")):
        r = client.post("/api/runs/3/profile", json=body, headers=auth)
        assert r.status_code == 422, body
        assert field in [str(p) for e in r.json()["detail"] for p in e["loc"]], r.json()
    r = client.post("/api/runs/3/profile", json={"steps": 3, "ranks": [4]}, headers=auth)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "ranks"]
    assert not any(service.captures.values())  # nothing asked by a refused request
    r = client.post("/api/runs/3/profile", json={"steps": 3}, headers=auth)
    assert r.status_code == 202
    assert r.json() | {"requested": 0} == {
        "run": 3, "capture": 1, "steps": 3, "ranks": [0], "requested": 0, "state": "waiting",
        "traces": [], "error": None, "first_step": None, "last_step": None,
        "report_url": "/runs/3/profiles/1", "trace_urls": {}}
    busy = client.post("/api/runs/3/profile", json={"steps": 3}, headers=auth)
    assert busy.status_code == 409 and "still under way" in busy.json()["detail"]
    ended = client.post("/api/runs/1/profile", json={"steps": 3}, headers=auth)
    assert ended.status_code == 409 and "not running on this node" in ended.json()["detail"]
    assert client.post("/api/runs/99/profile", json={"steps": 3},
                       headers=auth).status_code == 404


def test_the_report_page_reloads_until_ready_then_shows_the_report(
        client: TestClient, auth: dict[str, str], service: Any, tmp_path: Path) -> None:
    client.post("/api/runs/3/profile", json={"steps": 2}, headers=auth)
    waiting = client.get("/runs/3/profiles/1").text
    assert 'http-equiv="refresh"' in waiting and 'data-state="waiting"' in waiting
    assert "next report step" in waiting and "breakdown-table" not in waiting
    _ready(service, tmp_path)
    page = client.get("/runs/3/profiles/1").text
    assert 'http-equiv="refresh"' not in page and 'data-state="ready"' in page
    assert 'data-rank="0" data-window-ms="0.2" data-comm-ms="0.06"' in page
    assert re.search(r'data-key="idle_ms" data-ms="0.04"', page)
    assert "Rank 1 reached the step&#39;s first collective last in 2 of 2" in page
    assert page.count('class="trace-link"') == 2 and "1.2 KiB" in page
    assert "aten::mm" in page and 'id="chart-memory"' in page
    api = client.get("/api/runs/3/profiles/1").json()
    assert api["capture"]["state"] == "ready" and api["report"]["ranks"][0]["rank"] == 0
    assert api["capture"]["trace_urls"] == {"0": "/api/runs/3/profiles/1/traces/0",
                                            "1": "/api/runs/3/profiles/1/traces/1"}
    assert [c["capture"] for c in client.get("/api/runs/3/profiles").json()] == [1]
    assert client.get("/runs/3/profiles/2").status_code == 404
    assert client.get("/api/runs/99/profiles").status_code == 404


def test_traces_download_by_number_and_nothing_else(client: TestClient, auth: dict[str, str],
                                                    service: Any, tmp_path: Path) -> None:
    client.post("/api/runs/3/profile", json={"steps": 2}, headers=auth)
    _ready(service, tmp_path)
    r = client.get("/api/runs/3/profiles/1/traces/1")
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    assert 'filename="run3-profile1-rank1.json.gz"' in r.headers["content-disposition"]
    assert json.loads(gzip.decompress(r.content))["baseTimeNanoseconds"] == 10**12 + 400_000
    assert client.get("/api/runs/3/profiles/1/traces/2").status_code == 404
    for bad in ("../../etc/passwd", "rank0.json.gz", "-1", "%2e%2e"):
        assert client.get(f"/api/runs/3/profiles/1/traces/{bad}").status_code in (404, 422)


def test_the_run_page_offers_the_profile_form_and_lists_the_captures(
        client: TestClient, service: Any, tmp_path: Path) -> None:
    text = client.get("/runs/3").text
    assert 'id="profile-form"' in text and 'action="/runs/3/profile"' in text
    token = re.search(r'name="csrf_token" value="([^"]+)"', text)
    assert token
    bad = client.post("/runs/3/profile", data={"csrf_token": token.group(1), "steps": "x"},
                      follow_redirects=False)
    assert bad.status_code == 422 and service.captures == {}
    assert client.post("/runs/3/profile", data={"csrf_token": "wrong", "steps": "2"},
                       follow_redirects=False).status_code == 403
    ok = client.post("/runs/3/profile", data={"csrf_token": token.group(1), "steps": "2"},
                     follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/runs/3/profiles/1"
    listed = client.get("/runs/3").text
    assert 'id="profiles-table"' in listed and 'href="/runs/3/profiles/1"' in listed
    # an ended run: no form, its captures still listed
    assert 'id="profile-form"' not in client.get("/runs/1").text


def test_the_forms_fields_are_read_or_named() -> None:
    assert profile_fields("4", "") == (4, None)
    assert profile_fields(" 2 ", "0, 3 5") == (2, [0, 3, 5])
    for steps, ranks, words in (("0", "", "steps: a whole number from 1 to 50"),
                                ("five", "", "steps:"), ("3", "a,b", "ranks: rank numbers"),
                                ("3", "-1", "ranks: rank numbers, 0 or more")):
        with pytest.raises(ValueError, match=words):
            profile_fields(steps, ranks)
