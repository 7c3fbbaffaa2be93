"""Logging in and out of the pages: the token once for a session cookie."""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient

from traind.web.app import create_app as _create_app
from traind.web.routes.login import safe_next
from traind.web.sessions import COOKIE, Sessions

if TYPE_CHECKING:
    from collections.abc import Iterator

create_app = partial(_create_app, allowed_hosts=["testserver"])


@pytest.fixture
def client(service: Any) -> Iterator[TestClient]:
    with TestClient(create_app(service)) as c:
        yield c


def test_a_reader_without_a_session_sees_no_forms_and_no_live_token(client: TestClient) -> None:
    for path in ("/", "/experiments", "/runs", "/hardware", "/comm"):
        page = client.get(path).text
        assert 'name="csrf_token"' not in page, path
        assert '<meta name="traind-live" content="">' in page, path
        assert 'href="/login?next=' in page, path
    assert "Log in</a> with the daemon's token to submit" in client.get("/experiments").text


def test_the_token_buys_a_strict_httponly_session_cookie(client: TestClient, token: str) -> None:
    r = client.post("/login", data={"token": token, "next": "/experiments"},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/experiments"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/", "Max-Age="):
        assert attribute.lower() in cookie.lower(), cookie
    assert "secure" not in cookie.lower()  # plain http on loopback: a Secure cookie is lost
    assert token not in cookie
    page = client.get("/experiments").text
    assert re.search(r'name="csrf_token" value="[^"]{40,}"', page)
    assert re.search(r'<meta name="traind-live" content="[^"]{40,}">', page)
    assert 'action="/logout"' in page


def test_https_makes_the_cookie_secure(service: Any, token: str) -> None:
    with TestClient(create_app(service), base_url="https://testserver") as c:
        r = c.post("/login", data={"token": token}, follow_redirects=False)
    assert "secure" in r.headers["set-cookie"].lower()


@pytest.mark.parametrize("wrong", ["", "nope", "test-token-012345678"])
def test_a_wrong_token_is_401_and_no_cookie(client: TestClient, wrong: str) -> None:
    r = client.post("/login", data={"token": wrong}, follow_redirects=False)
    assert r.status_code == 401 and "wrong token" in r.text
    assert "set-cookie" not in r.headers


def test_a_cross_origin_login_is_refused(client: TestClient, token: str) -> None:
    r = client.post("/login", data={"token": token}, headers={"Origin": "http://evil.example"},
                    follow_redirects=False)
    assert r.status_code == 403 and "set-cookie" not in r.headers


def test_the_one_time_link_opens_a_session_once(service: Any) -> None:
    sessions = Sessions()
    code = sessions.login_code()
    with TestClient(create_app(service, sessions=sessions)) as c:
        r = c.get(f"/login?token={code}&next=/runs", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/runs"
        assert c.cookies.get(COOKIE)
    with TestClient(create_app(service, sessions=sessions)) as again:
        r = again.get(f"/login?token={code}", follow_redirects=False)
        assert r.status_code == 401 and "used already" in r.text
        assert not again.cookies.get(COOKIE)


def test_logging_out_ends_the_session(client: TestClient, token: str) -> None:
    client.post("/login", data={"token": token})
    sid = client.cookies.get(COOKIE)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/").text)
    assert csrf
    r = client.post("/logout", data={"csrf_token": csrf.group(1)}, follow_redirects=False)
    assert r.status_code == 303
    assert client.app.state.sessions.get(sid) is None  # type: ignore[attr-defined]


def test_closed_pages_send_a_reader_to_log_in(service: Any, token: str) -> None:
    with TestClient(create_app(service, open_pages=False)) as c:
        for path in ("/", "/runs", "/experiments", "/hardware"):
            r = c.get(path, follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == f"/login?next={path}"
        assert c.get("/login").status_code == 200  # the way in stays open
        assert c.get("/healthz").status_code == 200
        c.post("/login", data={"token": token})
        assert c.get("/runs", follow_redirects=False).status_code == 200


@pytest.mark.parametrize(("target", "safe"), [
    ("/experiments", "/experiments"), ("/runs?x=1", "/runs?x=1"), (None, "/"), ("", "/"),
    ("//evil.example/", "/"), ("https://evil.example/", "/"), ("/\\evil.example", "/"),
    ("evil", "/"), ("/a\nb", "/"),
])
def test_after_login_only_a_path_here(target: str | None, safe: str) -> None:
    assert safe_next(target) == safe
