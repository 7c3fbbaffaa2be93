"""Server-rendered HTML pages: the live overview and the runs table."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from traind.web.deps import ServiceDep, TemplatesDep
from traind.web.views import current_run, run_row, utcnow

router = APIRouter(default_response_class=HTMLResponse)


@router.get("/", include_in_schema=False)
async def overview(request: Request, service: ServiceDep, templates: TemplatesDep) -> HTMLResponse:
    runs = await run_in_threadpool(service.runs)  # blocking DB read: keep it off the loop
    live_run = service.live_snapshot()["run"]  # in memory, read on the loop (see api.py)
    run = current_run(runs, live_run)
    context = {"page": "overview", "run": run_row(run, utcnow()) if run else None}
    return templates.TemplateResponse(request, "overview.html", context)


@router.get("/runs", include_in_schema=False)
async def runs_page(request: Request, service: ServiceDep, templates: TemplatesDep) -> HTMLResponse:
    runs = await run_in_threadpool(service.runs)
    now = utcnow()
    context = {"page": "runs", "rows": [run_row(r, now) for r in runs]}
    return templates.TemplateResponse(request, "runs.html", context)
