"""Bodies are bounded before anyone parses them, the API's token is checked before its body
is read, and a JSON body is decoded off the event loop.

FastAPI reads and parses a route's body before it solves the route's dependencies, so the
token dependency alone (deps.require_token) would let a client without the token make the
daemon buffer and parse any body it sends. This middleware runs first: a state-changing
``/api/`` request without the token is answered 401 unread; a body over its limit is 413,
from its Content-Length at once, or from the stream as soon as it passes the limit.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers

from traind.web.deps import bearer_token, token_refusal

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_BODY_BYTES = 1 << 20  # a JSON body: an experiment with many arms is a few kilobytes
FORM_BODY_BYTES = 64 << 10  # a form: a few fields
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


async def _reply(send: Send, status: int, detail: str,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, api_bytes: int = API_BODY_BYTES,
                 form_bytes: int = FORM_BODY_BYTES) -> None:
        self.app, self.api_bytes, self.form_bytes = app, api_bytes, form_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in STATE_CHANGING:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        api = scope["path"].startswith("/api/")
        if api:
            refusal = token_refusal(scope["app"].state.service,
                                    bearer_token(headers.get("authorization")))
            if refusal is not None:
                await _reply(send, 401, refusal, ((b"www-authenticate", b"Bearer"),))
                return
        limit = self.api_bytes if api else self.form_bytes
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _reply(send, 413, f"the body may be at most {limit} bytes")
            return
        seen = 0
        replied = False

        async def bounded_receive() -> Message:
            # Past the limit the 413 goes out from here, and the route sees the client leave:
            # raising instead would reach FastAPI's body reader, which makes any error a 400.
            nonlocal seen, replied
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if not replied:
                        replied = True
                        await _reply(send, 413, f"the body may be at most {limit} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not replied:  # after a 413 whatever the route answers goes nowhere
                await send(message)

        await self.app(scope, bounded_receive, guarded_send)


class OffLoopJSONRequest(Request):
    """A request whose JSON body is decoded in a worker thread: a body up to the limit takes
    milliseconds to decode, and on the loop every websocket and /healthz would wait for it."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await anyio.to_thread.run_sync(json.loads, body)
        return self._json


def json_media_type(content_type: str | None) -> bool:
    """``application/json`` or a ``+json`` type, parameters (charset) aside."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                          and media.endswith("+json"))


def not_json(content_type: str | None) -> str:
    """The 415's detail: what the body must be, and what this request said it was."""
    said = f"'{content_type[:80]}'" if content_type else "none"
    return ("the body must be JSON, sent with Content-Type: application/json "
            f"(this request's Content-Type: {said})")


class OffLoopJSONRoute(APIRoute):
    """The API routers' route class: their handlers get an :class:`OffLoopJSONRequest`, and
    a body route refuses a body of another media type with 415 before parsing it (FastAPI
    would read curl's default form type as a non-dict and answer a puzzling 422)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def off_loop(request: Request) -> Response:
            has_body = request.headers.get("content-length", "0") != "0" or (
                "transfer-encoding" in request.headers)
            kind = request.headers.get("content-type")
            if takes_body and has_body and not json_media_type(kind):
                return JSONResponse({"detail": not_json(kind)}, status_code=415)
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return off_loop
