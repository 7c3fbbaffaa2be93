"""plotly.js and Swagger UI, served from their installed packages (see :mod:`traind.web.vendor`),
the API documentation page that loads the latter, and the favicon browsers ask for at
/favicon.ico whatever the page links."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from traind.web.vendor import docs_file, docs_version, plotly_js_path

router = APIRouter()

# Pages link it as ``...?v=<plotly version>``, so a year-long immutable cache is safe.
LONG_CACHE = "public, max-age=31536000, immutable"


@router.get("/static/vendor/plotly.min.js", include_in_schema=False)
async def plotly_js() -> FileResponse:
    return FileResponse(
        plotly_js_path(),
        media_type="text/javascript; charset=utf-8",
        headers={"Cache-Control": LONG_CACHE},
    )


FAVICON = Path(__file__).resolve().parents[1] / "static" / "favicon.svg"


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    # An SVG under the .ico name: every current browser reads it (and no page 404s on it).
    return FileResponse(FAVICON, media_type="image/svg+xml",
                        headers={"Cache-Control": "public, max-age=86400"})


DOCS_PATHS = ("/api/docs", "/api/redoc")  # web/headers.py: the CSP their inline start-up needs
_TYPES = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
DocsFile = Literal["swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"]


def _asset(name: str) -> str:
    return f"/static/vendor/docs/{name}?v={docs_version()}"


@router.get(DOCS_PATHS[0], include_in_schema=False)
async def api_docs(request: Request) -> HTMLResponse:
    """FastAPI's Swagger UI page, with its files from this daemon instead of a CDN."""
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url, title=f"{request.app.title} API",
        swagger_js_url=_asset("swagger-ui-bundle.js"), swagger_css_url=_asset("swagger-ui.css"),
        swagger_favicon_url="/favicon.ico")


@router.get(DOCS_PATHS[1], include_in_schema=False)
async def api_redoc(request: Request) -> HTMLResponse:
    """The same document in ReDoc, also from this daemon (and without Google's fonts)."""
    return get_redoc_html(openapi_url=request.app.openapi_url, title=f"{request.app.title} API",
                          redoc_js_url=_asset("redoc.standalone.js"),
                          redoc_favicon_url="/favicon.ico", with_google_fonts=False)


@router.get("/static/vendor/docs/{name}", include_in_schema=False)
async def docs_asset(name: DocsFile) -> FileResponse:
    # A fixed set of names (anything else is a 422): nothing a request sends names a path.
    return FileResponse(docs_file(name), media_type=_TYPES[name.rsplit(".", 1)[1]],
                        headers={"Cache-Control": LONG_CACHE})
