"""plotly.js, served from the installed ``plotly`` package (see :mod:`traind.web.vendor`), and
the favicon browsers ask for at /favicon.ico whatever the page links."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from traind.web.vendor import plotly_js_path

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
