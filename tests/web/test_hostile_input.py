"""Bodies and ids a careless or hostile client sends: each is a 422 naming the field, quoted
short, and never a 500."""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient

from traind.web.app import create_app as _create_app

if TYPE_CHECKING:
    from collections.abc import Iterator

create_app = partial(_create_app, allowed_hosts=["testserver"])
BIG = 2**63  # one past the database's integer


@pytest.fixture
def client(service: Any, token: str) -> Iterator[TestClient]:
    with TestClient(create_app(service), headers={"Authorization": f"Bearer {token}"}) as c:
        yield c


def body(**changes: Any) -> dict[str, Any]:
    return {"name": "e", "steps": 40, "block_steps": 10,
            "arms": [{"name": "a"}, {"name": "b"}], **changes}


def post_raw(client: TestClient, path: str, text: str) -> Any:
    return client.post(path, content=text, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/api/experiments/{}", "/api/experiments/{}/export",
                                  "/api/autotunes/{}", "/experiments/{}", "/autotunes/{}"])
@pytest.mark.parametrize("bad", [BIG, 10**30, 0, -1])
def test_an_id_out_of_range_is_422(client: TestClient, path: str, bad: int) -> None:
    r = client.get(path.format(bad))
    assert r.status_code == 422, (path, bad, r.text)


def test_cancelling_an_id_out_of_range_is_422(client: TestClient) -> None:
    for path in ("/api/experiments/{}/cancel", "/api/autotunes/{}/cancel"):
        assert client.post(path.format(BIG)).status_code == 422


@pytest.mark.parametrize(("field", "raw"), [
    ("loss_margin", "NaN"), ("loss_margin", "Infinity"), ("loss_margin", "-Infinity"),
    ("loss_margin", "1e400"), ("loss_margin", "2"), ("loss_margin", "-0.1"),
    ("steps", "true"), ("steps", '"40"'), ("steps", "40.5"), ("steps", str(BIG)),
    ("steps", "100000000"), ("block_steps", "false"), ("repeats", "1e400"),
    ("checkpoint_run", str(BIG)),
])
def test_a_bad_number_in_an_experiment_is_422_naming_it(
        client: TestClient, service: Any, field: str, raw: str) -> None:
    base = {k: v for k, v in body().items() if k != field}
    text = json.dumps(base)[:-1] + f', "{field}": {raw}}}'  # the raw JSON text, as sent
    r = post_raw(client, "/api/experiments", text)
    assert r.status_code == 422, (field, raw, r.text)
    assert any(field in e["loc"] for e in r.json()["detail"]), r.text
    assert service.specs == []


@pytest.mark.parametrize("bad", [{"loss_margin": float("inf")}, {"steps": True},
                                 {"bucket_mb": [float("nan")]}, {"bucket_mb": [0]},
                                 {"target_run_id": BIG}, {"max_rounds": True}])
def test_a_bad_number_in_a_search_is_422(client: TestClient, bad: dict[str, Any]) -> None:
    text = json.dumps({"name": "t", **bad}, allow_nan=True)
    r = post_raw(client, "/api/autotunes", text)
    assert r.status_code == 422, (bad, r.text)


def test_a_reorder_with_huge_ids_is_422(client: TestClient) -> None:
    r = client.post("/api/queue/reorder", json={"trial_ids": [BIG, 1]})
    assert r.status_code == 422


def test_a_422_quotes_the_input_short(client: TestClient) -> None:
    huge = "x" * 50_000
    r = client.post("/api/experiments", json=body(name=huge, arms=[{"name": huge}] * 9))
    assert r.status_code == 422
    assert len(r.content) < 4000, len(r.content)
    for e in r.json()["detail"]:
        assert "input" not in e or len(e["input"]) <= 83, e
    # Not JSON at all: a short quote too, not the whole text.
    r = post_raw(client, "/api/experiments", "{" + huge)
    assert r.status_code == 422 and len(r.content) < 4000


@pytest.mark.parametrize("url", [
    f"/runs/compare?ids={10**20}&ids=1", f"/api/runs/1/series?after={10**20}",
    f"/?run={10**20}", f"/api/live?run={BIG}", f"/api/comm/history?run={BIG}",
    "/runs/compare?ids=0&ids=1"])
def test_an_integer_out_of_range_in_a_query_is_422(client: TestClient, url: str) -> None:
    """Issue 40: these were 500s (SQLite's INTEGER overflowed) before they were bounded."""
    r = client.get(url)
    assert r.status_code == 422, (url, r.status_code, r.text[:300])


def _int_bounded(annotation: Any, metadata: list[Any]) -> list[str]:
    """Where an int in ``annotation`` (with ``metadata``) has no upper bound: a list of
    what is unbounded, empty when every int in it is bounded."""
    import types
    import typing

    import annotated_types

    if annotation is int:
        upper = any(isinstance(m, annotated_types.Le | annotated_types.Lt) for m in metadata)
        return [] if upper else ["int"]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        found = [m for e in extra for m in (getattr(e, "metadata", None) or [e])]
        return _int_bounded(inner, [*metadata, *found])
    if origin in (typing.Union, types.UnionType, list, tuple, set, frozenset):
        return [x for arg in typing.get_args(annotation) if arg is not type(None)
                for x in _int_bounded(arg, metadata if origin in (typing.Union,
                                                                   types.UnionType) else [])]
    return []


def test_every_integer_a_url_carries_is_bounded_where_it_is_declared(service: Any) -> None:
    """Path and query integers of every route, API and pages alike, have an upper bound: a
    number past the database's INTEGER is a 422 at the door, never an overflow inside."""
    from fastapi.routing import APIRoute, iter_route_contexts

    def params(dependant: Any) -> Iterator[Any]:
        yield from dependant.query_params
        yield from dependant.path_params
        for sub in dependant.dependencies:
            yield from params(sub)

    app = create_app(service)
    unbounded, seen = [], 0
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if not isinstance(route, APIRoute):
            continue
        for p in params(route.dependant):
            seen += 1
            if _int_bounded(p.field_info.annotation, list(p.field_info.metadata)):
                unbounded.append(f"{route.path} {p.name}: {p.field_info.annotation}")
    assert seen > 40  # the walk found the routes' parameters
    assert not unbounded, unbounded


def _body_routes(service: Any) -> list[tuple[str, str]]:
    """(method, path) of every API route that takes a JSON body, ids filled with 1."""
    from fastapi.routing import APIRoute, iter_route_contexts

    out = []
    for context in iter_route_contexts(create_app(service).routes):
        route = context.original_route
        if isinstance(route, APIRoute) and route.body_field is not None \
                and route.path.startswith("/api/"):
            path = "/".join("1" if part.startswith("{") else part
                            for part in route.path.split("/"))
            out += [(method, path) for method in sorted(route.methods)]
    return out


@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_is_415_saying_what_it_must_be(
        client: TestClient, service: Any, content_type: str) -> None:
    """Issue 40: curl's default form type got a 422 about a dictionary, with the body shown
    as a Python bytes literal."""
    routes = _body_routes(service)
    assert len(routes) >= 4, routes
    for method, path in routes:
        r = client.request(method, path, content=json.dumps(body()),
                           headers={"content-type": content_type})
        assert r.status_code == 415, (method, path, r.status_code, r.text[:300])
        detail = r.json()["detail"]
        assert "must be JSON" in detail and "Content-Type: application/json" in detail, detail
        assert content_type.split(";")[0] in detail and "b'" not in detail


def test_a_json_body_with_a_charset_or_a_json_suffix_is_taken(client: TestClient) -> None:
    for kind in ("application/json; charset=utf-8", "application/vnd.traind+json"):
        r = client.post("/api/experiments", content=json.dumps(body()),
                        headers={"content-type": kind})
        assert r.status_code != 415, (kind, r.text[:300])
