"""Every route of the app, found by walking ``app.routes`` (never a hand-kept list): each
state-changing one refuses a request without its credential, the websocket refuses a foreign
page, and every route refuses a Host header that names someone else.

Credentials by kind: the JSON API (``/api/...``) takes the daemon's token; the HTML forms,
posted by a browser that has no token, take a session (obtained once with the token at /login),
that session's CSRF token and a same-origin Origin. A new POST/PUT/PATCH/DELETE route without
either fails here, whatever its path; and everything an anonymous client can read (every page,
every hidden input, every meta tag, every cookie) opens none of them.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import fastapi.routing
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.websockets import WebSocketDisconnect

from tests.web.conftest import log_in
from traind.daemon.service import AutotuneSpec, ExperimentSpec
from traind.web.app import create_app
from traind.web.hosts import host_name
from traind.web.sessions import COOKIE

if TYPE_CHECKING:
    from collections.abc import Coroutine, Iterator

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# (method, path template) -> why it may change state without a credential. An entry must say
# why, and a stale entry fails the test below.
PUBLIC_STATE_CHANGING: dict[tuple[str, str], str] = {
    ("POST", "/login"): "it takes the daemon's token itself, and only makes a session",
}
FOREIGN = "http://evil.example"
TEST_HOST = "testserver"  # what TestClient sends


def _concrete(path: str) -> str:
    """A template path with every parameter set to 1 (an experiment, search or trial that
    exists in the fake service, so an unguarded route would really act)."""
    return re.sub(r"\{[^}]+\}", "1", path)


def _routes(app: FastAPI) -> list[tuple[BaseRoute, str, frozenset[str]]]:
    """(route, full path, methods) of everything in ``app.routes``. FastAPI 0.16x keeps an
    included router as one lazy entry there; ``iter_route_contexts`` (what its OpenAPI
    generator walks) opens them, with each route's prefixed path."""
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    if iter_contexts is None:  # older FastAPI: app.routes is already flat
        return [(r, str(getattr(r, "path", "")), frozenset(getattr(r, "methods", None) or ()))
                for r in app.routes]
    return [(c.original_route, str(c.path), frozenset(c.methods or ()))
            for c in iter_contexts(app.routes)]


def http_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path template) of every HTTP route (APIRoute is a Route)."""
    return [(m, path) for r, path, methods in _routes(app) if isinstance(r, Route)
            for m in sorted(methods)]


def mounts(app: FastAPI) -> list[str]:
    """A file under each mounted app's prefix (/static: read-only files)."""
    return [path + "/x" for r, path, _ in _routes(app) if isinstance(r, Mount)]


def websocket_routes(app: FastAPI) -> list[str]:
    # FastAPI's APIWebSocketRoute is a WebSocketRoute.
    return [path for r, path, _ in _routes(app) if isinstance(r, WebSocketRoute)]


def state_changing(app: FastAPI) -> list[tuple[str, str]]:
    return [(m, p) for m, p in http_routes(app)
            if m in STATE_CHANGING and (m, p) not in PUBLIC_STATE_CHANGING]


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    # In a thread of its own: after the browser tests, Playwright's sync API leaves an event
    # loop running in this one, and asyncio.run refuses to nest.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture
def app(service: Any, make_trials: Any) -> FastAPI:
    # Something for every id-taking route to act on: experiment 1, a running search 1, trials.
    _run(service.submit_experiment(ExperimentSpec(
        name="e", steps=10, arms=({"name": "a"}, {"name": "b"}))))
    _run(service.submit_autotune(AutotuneSpec(name="t")))
    service.trials = make_trials()
    return create_app(service, allowed_hosts=[TEST_HOST])


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


def _state(service: Any) -> str:
    """Everything a state-changing route could change in the fake service."""
    return repr((service.specs, service.tune_specs, service.trials,
                 service.experiment_infos, service.autotune_infos))


def _csrf(client: TestClient) -> str:
    """The CSRF token of the client's session (logging it in first if it has none)."""
    session = client.app.state.sessions.get(  # type: ignore[attr-defined]
        client.cookies.get(COOKIE))
    return str((session or log_in(client)).csrf)


def _session(client: TestClient) -> Any:
    return client.app.state.sessions.get(client.cookies.get(COOKIE))  # type: ignore[attr-defined]


def anonymous_secrets(client: TestClient, app: FastAPI) -> set[str]:
    """Every value an anonymous client can read off the pages: hidden inputs, meta tags,
    cookies, and every long token-like string of every GET route's body."""
    found: set[str] = set()
    for method, path in http_routes(app):
        if method != "GET":
            continue
        r = client.get(_concrete(path), follow_redirects=False)
        found |= set(re.findall(r'<input[^>]*type="hidden"[^>]*value="([^"]*)"', r.text))
        found |= set(re.findall(r'<meta[^>]*content="([^"]*)"', r.text))
        found |= set(re.findall(r"[A-Za-z0-9_-]{32,}", r.text))
        found |= set(r.cookies.values())
    found |= set(client.cookies.values())
    return found


def test_routes_are_found(app: FastAPI) -> None:
    """The walk sees both kinds of state-changing route and the websocket (a guard against
    a refactor that hides routes from it, which would make the tests below pass vacuously)."""
    changing = state_changing(app)
    assert sum(p.startswith("/api/") for _, p in changing) >= 4, changing
    assert sum(not p.startswith("/api/") for _, p in changing) >= 4, changing
    assert websocket_routes(app) == ["/ws/live"]
    for key in PUBLIC_STATE_CHANGING:
        assert key in http_routes(app), f"stale allow-list entry {key}"


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", "Basic dGVzdDp0ZXN0"])
def test_every_state_changing_api_route_needs_the_token(
        client: TestClient, app: FastAPI, service: Any, token: str, auth: str | None) -> None:
    api = [(m, p) for m, p in state_changing(app) if p.startswith("/api/")]
    before = _state(service)
    for method, path in api:
        headers = {"Authorization": auth} if auth else {}
        # A session, its CSRF token and a same-host Origin are no substitute for the token.
        headers["Origin"] = f"http://{TEST_HOST}"
        r = client.request(method, _concrete(path), json={}, headers=headers,
                           params={"csrf_token": _csrf(client)})
        assert r.status_code in (401, 403), (method, path, r.status_code, r.text)
    assert _state(service) == before
    # The same requests with the token get past the guard (so the refusals above were it).
    for method, path in api:
        r = client.request(method, _concrete(path), json={},
                           headers={"Authorization": f"Bearer {token}"})
        assert r.status_code not in (401, 403), (method, path, r.status_code, r.text)


def test_mounted_apps_take_no_writes(client: TestClient, app: FastAPI) -> None:
    for path in mounts(app):
        for method in sorted(STATE_CHANGING):
            r = client.request(method, path, data={"csrf_token": _csrf(client)})
            assert r.status_code == 405, (method, path, r.status_code)


def test_nothing_an_anonymous_page_reveals_changes_state(
        client: TestClient, app: FastAPI, service: Any) -> None:
    """The attack of issue 11: read every page without the token, take every value it shows,
    and post each form route with each of them, with and without a same-host Origin."""
    forms = [(m, p) for m, p in state_changing(app) if not p.startswith("/api/")]
    before = _state(service)
    revealed = anonymous_secrets(client, app)
    assert not any(v == service.token for v in revealed)
    for method, path in forms:
        for value in sorted(revealed | {""}):
            for headers in ({}, {"Origin": f"http://{TEST_HOST}"}):
                r = client.request(method, _concrete(path), headers=headers,
                                   data={"csrf_token": value, "trial_ids": ["21", "22"]},
                                   follow_redirects=False)
                assert r.status_code in (401, 403), (method, path, r.status_code, r.text)
    assert _state(service) == before


def test_every_state_changing_form_route_needs_the_sessions_csrf_token(
        client: TestClient, app: FastAPI, service: Any) -> None:
    forms = [(m, p) for m, p in state_changing(app) if not p.startswith("/api/")]
    other = TestClient(app)
    other_csrf = log_in(other).csrf  # another browser's session
    before = _state(service)
    token = _csrf(client)
    for method, path in forms:
        for data in ({}, {"csrf_token": "forged"}, {"csrf_token": other_csrf}):
            r = client.request(method, _concrete(path), data=data, follow_redirects=False)
            assert r.status_code == 403, (method, path, data, r.status_code, r.text)
        # The right token from a foreign page, or another scheme or port: still refused.
        for origin in (FOREIGN, "null", f"https://{TEST_HOST}", f"http://{TEST_HOST}:8080"):
            r = client.request(method, _concrete(path), data={"csrf_token": token},
                               headers={"Origin": origin}, follow_redirects=False)
            assert r.status_code == 403, (method, path, origin, r.status_code, r.text)
        # The right token without the session cookie (it was read off a page somehow).
        bare = TestClient(app)
        r = bare.request(method, _concrete(path), data={"csrf_token": token},
                         follow_redirects=False)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
    assert _state(service) == before
    # With the session, its token and no foreign Origin the guard lets it through (logging
    # in again each time: one of the routes is /logout).
    for method, path in forms:
        r = client.request(method, _concrete(path), data={"csrf_token": _csrf(client)},
                           headers={"Origin": f"http://{TEST_HOST}"}, follow_redirects=False)
        assert r.status_code != 403, (method, path, r.status_code, r.text)
        client.cookies.clear()


def _live(client: TestClient, path: str) -> str:
    session = _session(client) or log_in(client)
    return f"{path}?live={session.live}"


def test_a_foreign_websocket_is_closed_before_any_data(client: TestClient, app: FastAPI) -> None:
    for path in websocket_routes(app):
        for origin in (FOREIGN, "null", "http://testserver.evil.example"):
            with (
                pytest.raises(WebSocketDisconnect) as exc,
                client.websocket_connect(_live(client, path), headers={"origin": origin}) as ws,
            ):
                ws.receive_json()  # the handshake itself is refused: nothing to receive
            assert exc.value.code == 1008, (path, origin)
        # A session's live token without the session's cookie: refused.
        with (
            pytest.raises(WebSocketDisconnect) as exc,
            TestClient(app).websocket_connect(_live(client, path)) as ws,
        ):
            ws.receive_json()
        assert exc.value.code == 1008, path
        # Same origin but no credential: refused too (the handshake is the websocket's
        # "state-changing" request: it opens a subscription).
        with (
            pytest.raises(WebSocketDisconnect) as exc,
            client.websocket_connect(path, headers={"origin": f"http://{TEST_HOST}"}) as ws,
        ):
            ws.receive_json()
        assert exc.value.code == 1008, path
        with client.websocket_connect(_live(client, path),
                                      headers={"origin": f"http://{TEST_HOST}"}) as ws:
            assert ws.receive_json()["type"] == "snapshot"


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example:8800",
                                  "testserver.evil.example", "", "[::1", "a:b:c"])
def test_every_route_refuses_a_foreign_host(
        client: TestClient, app: FastAPI, service: Any, token: str, host: str) -> None:
    before = _state(service)
    for method, path in [*http_routes(app), *(("GET", p) for p in mounts(app))]:
        r = client.request(method, _concrete(path), headers={
            "host": host, "Authorization": f"Bearer {token}"}, follow_redirects=False)
        assert r.status_code == 400, (method, path, r.status_code)
    assert _state(service) == before
    for path in websocket_routes(app):
        with (
            pytest.raises(WebSocketDisconnect),
            client.websocket_connect(_live(client, path), headers={"host": host}) as ws,
        ):
            ws.receive_json()


@pytest.mark.parametrize("host", ["127.0.0.1:8800", "localhost", "LOCALHOST:80", "[::1]:8800",
                                  "node-7.cluster:8800"])
def test_loopback_and_configured_names_are_served(service: Any, host: str) -> None:
    app = create_app(service, allowed_hosts=["0.0.0.0", "Node-7.Cluster"])
    with TestClient(app) as c:
        assert c.get("/api/runs", headers={"host": host}).status_code == 200
        # The token, not a session: the cookie jar of the test client files cookies by the
        # URL's host, and this test is about the Host header.
        with c.websocket_connect(f"/ws/live?token={service.token}", headers={"host": host}) as ws:
            assert ws.receive_json()["type"] == "snapshot"


def test_an_ipv6_bind_address_is_a_name_too(service: Any) -> None:
    with TestClient(create_app(service, allowed_hosts=["fd00::7"])) as c:
        assert c.get("/healthz", headers={"host": "[fd00::7]:8800"}).status_code == 200
        assert c.get("/healthz", headers={"host": "[fd00::8]:8800"}).status_code == 400


@pytest.mark.parametrize(("header", "name"), [
    ("127.0.0.1:8800", "127.0.0.1"),
    ("LocalHost", "localhost"),
    ("[::1]:8800", "::1"),
    ("[::1]", "::1"),
    ("traind:8800", "traind"),
    (None, None),
    ("", None),
    ("[::1", None),
    ("[::1]x", None),
    ("::1", None),  # a bare IPv6 address is not a valid Host header
    ("host:port", None),
    (":8800", None),
])
def test_host_name(header: str | None, name: str | None) -> None:
    assert host_name(header) == name
