"""Host header checking: a request must name this daemon, or it gets 400.

A page on any site can make a browser send requests to ``127.0.0.1:8800`` once its own domain
name resolves there (DNS rebinding); the same-origin policy then treats the daemon as that
site's. The Host header still carries the attacker's name, so answering only to the names the
daemon is known by closes that door, for the websocket as much as for plain HTTP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from collections.abc import Iterable

    from starlette.requests import HTTPConnection
    from starlette.types import ASGIApp, Receive, Scope, Send

# Always allowed: the names a browser on this machine uses for a loopback daemon.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def host_name(header: str | None) -> str | None:
    """The name part of a Host header, lower-cased, without the port and IPv6 brackets:
    ``"[::1]:8800"`` -> ``"::1"``, ``"LocalHost:80"`` -> ``"localhost"``; None if malformed."""
    if not header:
        return None
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: [addr] or [addr]:port
        addr, sep, rest = header[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return addr or None
    name, sep, port = header.partition(":")
    if sep and not port.isdigit():
        return None  # a bare IPv6 address without brackets, or junk after the colon
    return name or None


DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


def same_origin(origin: str | None, scheme: str, host: str | None) -> bool:
    """True when there is no Origin (a non-browser client), or it names this very origin:
    the scheme the request came in on (``ws``/``wss`` count as ``http``/``https``), the Host
    it names, and the port (a default port may be left out on either side)."""
    if origin is None:
        return True
    if host is None:
        return False
    parts = urlsplit(origin)
    want_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    if parts.scheme != want_scheme or not parts.netloc or parts.path not in ("", "/"):
        return False
    return _with_port(parts.netloc, want_scheme) == _with_port(host, want_scheme)


def from_this_origin(conn: HTTPConnection) -> bool:
    """:func:`same_origin` for a request or a websocket handshake, from its own headers."""
    return same_origin(conn.headers.get("origin"), conn.url.scheme, conn.headers.get("host"))


def _with_port(netloc: str, scheme: str) -> str:
    netloc = netloc.strip().lower()
    bare = netloc.rsplit("]", 1)[-1] if netloc.startswith("[") else netloc
    return netloc if ":" in bare else f"{netloc}:{DEFAULT_PORTS.get(scheme, '')}"


def allowed_names(extra: Iterable[str]) -> frozenset[str]:
    """The loopback names plus ``extra`` (the bind address, ``daemon.allowed_hosts``), as
    :func:`host_name` spells them (an entry may carry brackets or a port)."""
    names = set(LOOPBACK)
    for entry in extra:
        name = host_name(entry if not _bare_ipv6(entry) else f"[{entry}]")
        if name:
            names.add(name)
    return frozenset(names)


def _bare_ipv6(entry: str) -> bool:
    return entry.count(":") > 1 and not entry.startswith("[")


class HostCheckMiddleware:
    """400 for an HTTP request, and a refused handshake (403, before any data) for a websocket,
    whose Host header names none of ``allowed``."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        if host_name(Headers(scope=scope).get("host")) in self.allowed:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # Closing before accept: the server answers the handshake with 403.
            await send({"type": "websocket.close", "code": 1008, "reason": "unknown host"})
            return
        # JSON like every other error of the API (ErrorOut), so one 400 shape is documented.
        response = JSONResponse({"detail": "the Host header names no address of this daemon "
                                 "(add it to daemon.allowed_hosts)"}, status_code=400)
        await response(scope, receive, send)
