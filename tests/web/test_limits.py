"""Bodies bounded before parsing, the token before the body (web/limits.py), driven at the
ASGI level so the test sees exactly how much of a body the daemon asked for."""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

import pytest

from tests.web.test_security import _run
from traind.web.app import create_app as _create_app
from traind.web.limits import API_BODY_BYTES, FORM_BODY_BYTES

create_app = partial(_create_app, allowed_hosts=["testserver"])


async def _call(app: Any, method: str, path: str, headers: dict[str, str],
                chunks: list[bytes]) -> tuple[int, dict[str, Any], int]:
    """(status, JSON body, chunks the app read) for one request."""
    read = 0
    queue = list(chunks)

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not queue:
            await asyncio.sleep(3600)  # a client that never sends the rest
        read += 1
        body = queue.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(queue)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "scheme": "http", "server": ("testserver", 80), "client": ("127.0.0.1", 5000),
             "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         {"host": "testserver", **headers}.items()]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body or b"{}"), read


def call(app: Any, method: str, path: str, headers: dict[str, str],
         chunks: list[bytes]) -> tuple[int, dict[str, Any], int]:
    return _run(_call(app, method, path, headers, chunks))


@pytest.mark.parametrize("auth", [None, "Bearer wrong"])
def test_no_token_is_401_before_a_byte_of_the_body_is_read(service: Any, auth: str | None
                                                           ) -> None:
    app = create_app(service)
    headers = {"content-type": "application/json", "content-length": str(100 << 20)}
    if auth:
        headers["authorization"] = auth
    status, body, read = call(app, "POST", "/api/experiments", headers, [b"{" * 65536])
    assert status == 401 and "token" in body["detail"]
    assert read == 0
    assert service.specs == []


def test_a_declared_length_over_the_limit_is_413_unread(service: Any, token: str) -> None:
    app = create_app(service)
    status, body, read = call(app, "POST", "/api/experiments", {
        "authorization": f"Bearer {token}", "content-type": "application/json",
        "content-length": str(API_BODY_BYTES + 1)}, [b"x"])
    assert status == 413 and str(API_BODY_BYTES) in body["detail"]
    assert read == 0


def test_a_streamed_body_is_cut_off_at_the_limit(service: Any, token: str) -> None:
    app = create_app(service)
    chunk = b" " * (256 << 10)
    status, _, read = call(app, "POST", "/api/experiments", {
        "authorization": f"Bearer {token}", "content-type": "application/json",
        "transfer-encoding": "chunked"}, [chunk] * 40)  # 10 MiB on offer
    assert status == 413
    assert read == API_BODY_BYTES // len(chunk) + 1  # not one chunk past the limit
    assert service.specs == []


def test_a_form_body_has_a_smaller_limit(service: Any) -> None:
    app = create_app(service)
    status, _, read = call(app, "POST", "/experiments", {
        "content-type": "application/x-www-form-urlencoded",
        "content-length": str(FORM_BODY_BYTES + 1)}, [b"a=1"])
    assert status == 413 and read == 0


def test_a_body_within_the_limit_gets_through(service: Any, token: str) -> None:
    app = create_app(service)
    body = json.dumps({"name": "e", "steps": 40, "block_steps": 10,
                       "arms": [{"name": "a"}, {"name": "b"}]}).encode()
    status, out, _ = call(app, "POST", "/api/experiments", {
        "authorization": f"Bearer {token}", "content-type": "application/json",
        "content-length": str(len(body))}, [body])
    assert status == 201, out


def test_the_api_decodes_json_off_the_event_loop(service: Any, token: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from fastapi.testclient import TestClient

    import traind.web.limits as limits

    threads: list[str] = []
    real = json.loads

    def recording(text: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(limits.json, "loads", recording)
    with TestClient(create_app(service), headers={"Authorization": f"Bearer {token}"}) as c:
        loop_thread = c.portal.call(lambda: threading.current_thread().name)  # type: ignore[union-attr]
        r = c.post("/api/experiments", json={"name": "e", "steps": 40, "block_steps": 10,
                                             "arms": [{"name": "a"}, {"name": "b"}]})
        assert r.status_code == 201, r.text
        bad = c.post("/api/experiments", content=b"{not json",
                     headers={"content-type": "application/json"})
        assert bad.status_code == 422  # a decode error is still the documented 422
    assert threads and loop_thread not in threads, (threads, loop_thread)
