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
