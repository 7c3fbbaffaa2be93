"""The FastAPI app factory: wires the node service, templates, static files and routers.

The daemon builds the service and calls :func:`create_app`; nothing here is created at import
time, so every test builds its own app around its own fake service.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.middleware.gzip import GZipMiddleware

from traind.daemon.db.engine import REFUSED
from traind.daemon.service import ShuttingDown
from traind.web.headers import SecurityHeadersMiddleware
from traind.web.heavy import HeavyReads
from traind.web.hosts import HostCheckMiddleware, allowed_names
from traind.web.limits import BodyLimitMiddleware
from traind.web.nodeviews import metric_help
from traind.web.routes import (
    api,
    assets,
    autotune_pages,
    autotunes,
    experiment_pages,
    experiments,
    live,
    login,
    metrics,
    pages,
    run_pages,
    runs,
)
from traind.web.schemas import ErrorOut
from traind.web.sessions import Sessions, current_session
from traind.web.vendor import plotly_version

if TYPE_CHECKING:
    from collections.abc import Iterable

    from traind.daemon.service import NodeService

HERE = Path(__file__).parent
log = logging.getLogger(__name__)


def create_app(
    service: NodeService, *, title: str = "traind", allowed_hosts: Iterable[str] = (),
    sessions: Sessions | None = None, open_pages: bool = True,
) -> FastAPI:
    """Build the web app around ``service``, the daemon's side of :class:`NodeService`.

    Requests must name this daemon in their Host header: a loopback name or one of
    ``allowed_hosts`` (the bind address and ``daemon.allowed_hosts``); see web/hosts.py.
    Browsers change state only through a session (``sessions``, web/sessions.py); with
    ``open_pages`` false they need one to read the pages too."""
    # API docs under /api so the page namespace (/, /runs, ...) stays the dashboard's.
    app = FastAPI(
        # Docs: routes/assets.py serves Swagger UI from its package (no CDN on a closed node).
        title=title, docs_url=None, redoc_url=None, openapi_url="/api/openapi.json",
        # Any route: a Host the daemon does not answer to (web/hosts.py); a body route: a body
        # that is not JSON at all (before validation, which is the 422).
        responses={400: {"model": ErrorOut, "description": "Unknown Host header, or a body "
                         "that does not parse."},
                   413: {"model": ErrorOut, "description": "A body over the limit (1 MiB for "
                         "the API, 64 KiB for a form; web/limits.py)."},
                   415: {"model": ErrorOut, "description": "A body that was not sent as "
                         "JSON (Content-Type: application/json)."},
                   503: {"model": ErrorOut, "description": "The database refuses requests "
                         "just now; nothing was changed."}},
    )
    app.add_exception_handler(RequestValidationError, short_validation_error)
    for refused in REFUSED:  # the database refused: the daemon stays up and says so
        app.add_exception_handler(refused, database_unavailable)
    app.add_exception_handler(ShuttingDown, shutting_down)
    app.state.service = service
    app.state.heavy = HeavyReads()
    app.state.templates = _templates(title)
    app.state.sessions = Sessions() if sessions is None else sessions
    app.state.open_pages = open_pages

    # The plotly route comes before the /static mount: a mount matches its whole prefix.
    app.include_router(assets.router)
    app.include_router(login.router)
    app.include_router(pages.router)
    app.include_router(run_pages.router)
    app.include_router(experiment_pages.router)
    app.include_router(autotune_pages.router)
    app.include_router(api.router)
    app.include_router(runs.router)
    app.include_router(experiments.router)
    app.include_router(autotunes.router)
    app.include_router(live.router)
    app.include_router(metrics.router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    # Text compresses 3-10x (plotly.min.js: 4.8 MB -> ~1.4 MB); level 6 costs a tenth of 9's
    # CPU for nearly its size, and the long-cached assets are compressed once per browser.
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=6)
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(SecurityHeadersMiddleware, docs_paths=assets.DOCS_PATHS)
    # Added last, so it runs first: a foreign Host is refused before anything else happens.
    app.add_middleware(HostCheckMiddleware, allowed=allowed_names(allowed_hosts))
    return app


EXCERPT = 80  # characters of a bad input a 422 quotes back


def excerpt(value: Any) -> str:
    """A short quote of an input: a 422 must not echo a whole (possibly huge) body back."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= EXCERPT else text[:EXCERPT] + "..."


async def short_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 (each error's type, loc and msg) with the input quoted short."""
    assert isinstance(exc, RequestValidationError)
    items = [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg"),
              **({"input": excerpt(e["input"])} if "input" in e else {})}
             for e in exc.errors()]
    return JSONResponse({"detail": jsonable_encoder(items)},
                        status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: the database refused: %s", request.method, request.url.path,
                str(exc).splitlines()[0][:200])
    return JSONResponse({"detail": "the database refuses the daemon's requests just now "
                         "(read-only, locked or unreachable); nothing was changed: try again "
                         "shortly"}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                        headers={"Retry-After": "5"})


async def shutting_down(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, headers={"Retry-After": "30"},
                        status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


def _session_context(request: Request) -> dict[str, Any]:
    """What a page may carry for its session: the forms' CSRF token and the live websocket's
    token, or nothing at all for a reader without one."""
    session = current_session(request)
    return {"session": session, "csrf_token": session.csrf if session else "",
            "live_token": session.live if session else ""}


def _templates(title: str) -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates",
                                context_processors=[_session_context])
    # metric_help: the catalog's help text, as tooltips on the hardware and comm pages.
    templates.env.globals.update(
        title=title, plotly_version=plotly_version(), metric_help=metric_help
    )
    return templates
