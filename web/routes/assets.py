"""plotly.js, served from the installed ``plotly`` package (see :mod:`traind.web.vendor`)."""

from __future__ import annotations

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
