"""The live websocket: the hub's snapshot first, then every message as it is published.

Only same-host pages may connect: a websocket is not covered by the same-origin policy, so any
site the user visits could otherwise open one to a daemon on localhost and read its telemetry.
And every handshake carries a credential: the daemon's token (``Authorization: Bearer`` or
``?token=``, for programs) or the live token embedded in the daemon's own pages (``?live=``,
the same random value as the forms' CSRF token), so a local process that cannot read the token
file or a page cannot subscribe either.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
from fastapi import APIRouter, WebSocket, WebSocketDisconnect, status

from traind.web.deps import ServiceDep

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

router = APIRouter()


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """True when there is no Origin (a non-browser client) or it names the host served."""
    if origin is None:
        return True
    if host is None:
        return False
    netloc = urlsplit(origin).netloc
    return bool(netloc) and netloc.lower() == host.lower()


def credential_ok(websocket: WebSocket, service: ServiceDep) -> bool:
    """The daemon's token (header or query), or the pages' live token (query)."""
    auth = websocket.headers.get("authorization", "")
    token = auth[7:] if auth.lower().startswith("bearer ") else websocket.query_params.get("token")
    if token and service.check_token(token):
        return True
    live = websocket.query_params.get("live") or ""
    expected: str = websocket.app.state.csrf_token
    return live != "" and secrets.compare_digest(live, expected)


@router.websocket("/ws/live")
async def live(websocket: WebSocket, service: ServiceDep) -> None:
    if not (origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host"))
            and credential_ok(websocket, service)):
        # Closing before accept makes the server answer the handshake with 403; the code is
        # what the ASGI spec and Starlette's test client report.
        await websocket.close(code=status.WS_1008_POLICY_VIOLATION)
        return
    await websocket.accept()
    # Subscribe before taking the snapshot so nothing published in between is lost; neither
    # step awaits, so nothing lands in both either (the page also drops repeated steps).
    async with service.subscribe() as messages:
        try:
            await websocket.send_json(service.live_snapshot())
            async with anyio.create_task_group() as tg:

                async def forward() -> None:
                    await _forward(websocket, messages)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await _until_disconnect(websocket)
                    tg.cancel_scope.cancel()

                # Watching the receive side frees the subscription as soon as the browser goes,
                # rather than at the next publish (which, between runs, may never come).
                tg.start_soon(forward)
                tg.start_soon(watch)
        except* WebSocketDisconnect:
            # The browser went away mid-send; a task group wraps that in an ExceptionGroup.
            pass


async def _forward(websocket: WebSocket, messages: AsyncIterator[dict[str, Any]]) -> None:
    async for message in messages:
        await websocket.send_json(message)


async def _until_disconnect(websocket: WebSocket) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
