"""The live websocket: the hub's snapshot first, then every message as it is published.

Only same-host pages may connect: a websocket is not covered by the same-origin policy, so any
site the user visits could otherwise open one to a daemon on localhost and read its telemetry.
And every handshake carries a credential: the daemon's token (``Authorization: Bearer`` or
``?token=``, for programs), or a browser session's cookie together with that session's live
token (``?live=``, embedded only in pages rendered for the session), so a process that can read
the pages but holds neither the token nor a session cannot subscribe.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import APIRouter, WebSocket, WebSocketDisconnect, status

from traind.web.deps import ServiceDep
from traind.web.hosts import from_this_origin
from traind.web.sessions import current_session

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

router = APIRouter()

# A send that has not gone out in this long means the client stopped reading: its socket and
# then the server's write buffer are full, the send waits for a drain that never comes, and so
# would the server's keepalive ping (written behind the data), which is what would otherwise
# let the client go. At a fast job's rate that is how a client that never reads stays
# subscribed forever (tests/e2e/test_load.py). Generous: a browser tab in the background still
# reads its socket.
SEND_TIMEOUT = 30.0
CLOSE_TIMEOUT = 5.0


def credential_ok(websocket: WebSocket, service: ServiceDep) -> bool:
    """The daemon's token (header or query), or a session with its live token (query)."""
    auth = websocket.headers.get("authorization", "")
    token = auth[7:] if auth.lower().startswith("bearer ") else websocket.query_params.get("token")
    if token and service.check_token(token):
        return True
    session = current_session(websocket)
    live = websocket.query_params.get("live") or ""
    return session is not None and live != "" and secrets.compare_digest(live, session.live)


@router.websocket("/ws/live")
async def live(websocket: WebSocket, service: ServiceDep) -> None:
    if not (from_this_origin(websocket) and credential_ok(websocket, service)):
        # Closing before accept makes the server answer the handshake with 403; the code is
        # what the ASGI spec and Starlette's test client report.
        await websocket.close(code=status.WS_1008_POLICY_VIOLATION)
        return
    await websocket.accept()
    # Subscribe before taking the snapshot so nothing published in between is lost; neither
    # step awaits, so nothing lands in both either (the page also drops repeated steps).
    async with service.subscribe() as messages:
        try:
            await websocket.send_json(service.live_snapshot(_run(websocket)))
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


async def _forward(websocket: WebSocket, messages: AsyncIterator[dict[str, Any]],
                   send_timeout: float = SEND_TIMEOUT) -> None:
    """Send every message; a send stalled for ``send_timeout`` ends the connection."""
    async for message in messages:
        with anyio.move_on_after(send_timeout) as scope:
            await websocket.send_json(message)
        if scope.cancelled_caught:
            # The close frame waits behind the same full buffer: give it a moment, then leave
            # (the server closes the connection when the endpoint returns).
            with anyio.move_on_after(CLOSE_TIMEOUT):
                await websocket.close(code=status.WS_1008_POLICY_VIOLATION,
                                      reason="client stopped reading")
            return


async def _until_disconnect(websocket: WebSocket) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return


def _run(websocket: WebSocket) -> int | None:
    """The run a page follows (``?run=``; its snapshot is sent first), or None: the newest."""
    raw = websocket.query_params.get("run", "")
    return int(raw) if raw.isdigit() and len(raw) <= 18 else None
