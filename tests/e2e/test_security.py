"""The guards against a real `traind serve`: its own Host names only, the token on the API, and
no websocket for a foreign page (tests/web/test_security.py walks every route of the app; this
checks the daemon wires the same app with its bind address and ``daemon.allowed_hosts``)."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example", "traind"])
def test_a_foreign_host_gets_400(daemon: Any, host: str) -> None:
    r = daemon.get("/api/runs", headers={"Host": host})
    assert r.status_code == 400 and "allowed_hosts" in r.text


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "localhost"])
def test_loopback_names_are_served(daemon: Any, host: str) -> None:
    r = daemon.get("/api/runs", headers={"Host": host.format(port=daemon.port)})
    assert r.status_code == 200


def test_a_post_without_the_token_is_401(daemon: Any) -> None:
    r = httpx.post(daemon.url + "/api/experiments", json={}, timeout=10)
    assert r.status_code == 401


def _handshake(port: int, *, host: str, origin: str | None = None,
               path: str = "/ws/live") -> tuple[int, bytes]:
    """A websocket handshake written by hand (a client library sets Host itself): the status
    code and whatever else the server sent within a second (nothing, when refused)."""
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Upgrade: websocket",
             "Connection: Upgrade", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
             "Sec-WebSocket-Version: 13", *([f"Origin: {origin}"] if origin else [])]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        sock.settimeout(1.0)
        deadline = time.monotonic() + 2  # an accepted socket streams on while the job trains
        try:
            while time.monotonic() < deadline and (chunk := sock.recv(65536)):
                data += chunk
        except TimeoutError:
            pass  # an accepted socket stays open
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def test_the_websocket_refuses_foreign_pages_and_hosts(daemon: Any) -> None:
    here = f"127.0.0.1:{daemon.port}"
    path = f"/ws/live?token={(daemon.var_dir / 'token').read_text().strip()}"
    status, frames = _handshake(daemon.port, host=here, origin=f"http://{here}", path=path)
    assert status == 101 and b"snapshot" in frames
    # Refused: a 403 whose body (if any) is no websocket frame, so no telemetry.
    for kw in ({"host": here, "origin": "http://evil.example", "path": path},
               {"host": "evil.example", "path": path},
               {"host": here, "origin": f"http://{here}"}):  # no credential
        status, body = _handshake(daemon.port, **kw)
        assert status == 403 and b"snapshot" not in body, (kw, body)
