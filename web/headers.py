"""Security headers on every response: no framing (a framed page can be clicked into
cancelling an experiment), no MIME sniffing, no referrer leaving the daemon for another site,
and a CSP that runs only the daemon's own script files.

The pages have no inline script (data rides in ``type="application/json"`` blocks, which a CSP
does not execute); styles may be inline because plotly.js writes its own. FastAPI's API docs
page is the one exception: it boots Swagger UI with an inline script from its CDN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.datastructures import MutableHeaders

if TYPE_CHECKING:
    from collections.abc import Sequence

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
# /api/docs and /api/redoc start from an inline script (FastAPI's pages); their files are
# ours. ReDoc runs its search in a web worker made from a blob.
DOCS_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; worker-src 'self' blob:; "
            "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
            "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer would make form posts send Origin: null
    "Cross-Origin-Opener-Policy": "same-origin",
}


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp, *, docs_paths: Sequence[str] = ()) -> None:
        self.app, self.docs_paths = app, frozenset(docs_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        csp = DOCS_CSP if scope["path"] in self.docs_paths else CSP

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers.setdefault(name, value)
                headers.setdefault("Content-Security-Policy", csp)
            await send(message)

        await self.app(scope, receive, with_headers)
