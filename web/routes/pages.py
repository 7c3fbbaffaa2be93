"""Server-rendered HTML pages: the live overview, the runs table, hardware and communication.

The hardware and communication pages refresh by fetching themselves with ``?fragment=1``: the
server renders the same panel template it embeds in the full page, so units are formatted in
one place (traind.web.views) and the browser only swaps HTML (static/refresh.js).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from traind.web.autotune_views import PromotionRow, promotion_row
from traind.web.deps import ServiceDep, TemplatesDep, require_reader
from traind.web.nodeviews import comm_view, hardware_view
from traind.web.views import current_run, overview_choices, run_row, utcnow

if TYPE_CHECKING:
    from fastapi.templating import Jinja2Templates

# Reading pages may be closed to anyone without a session (daemon.open_pages).
router = APIRouter(default_response_class=HTMLResponse, dependencies=[Depends(require_reader)])


@router.get("/", include_in_schema=False)
async def overview(request: Request, service: ServiceDep, templates: TemplatesDep,
                   run: int | None = None) -> HTMLResponse:
    """The live overview of one run: ``?run=`` (the picker's), else ``current_run``'s choice.
    It stays on that run: another run's messages neither switch nor wipe it."""
    runs = await run_in_threadpool(service.runs)  # blocking DB read: keep it off the loop
    live_run = service.live_snapshot()["run"]  # in memory, read on the loop (see api.py)
    shown = current_run(runs, live_run, chosen=run)
    now = utcnow()
    context = {"page": "overview", "run": run_row(shown, now) if shown else None,
               "picker": [run_row(r, now) for r in overview_choices(runs, shown)]}
    return templates.TemplateResponse(request, "overview.html", context)


@router.get("/runs", include_in_schema=False)
async def runs_page(request: Request, service: ServiceDep, templates: TemplatesDep) -> HTMLResponse:
    runs, promotions = await run_in_threadpool(lambda: (service.runs(), service.promotions()))
    now = utcnow()
    by_run: dict[int, list[PromotionRow]] = {}
    for p in promotions:  # newest first, as under each run
        by_run.setdefault(p.run_id, []).append(promotion_row(p))
    context = {"page": "runs", "rows": [run_row(r, now) for r in runs], "promotions": by_run}
    return templates.TemplateResponse(request, "runs.html", context)


@router.get("/hardware", include_in_schema=False)
async def hardware_page(
    request: Request, service: ServiceDep, templates: TemplatesDep, fragment: bool = False
) -> HTMLResponse:
    # One collection for host, process and GPU series: every samples() call runs every
    # collector (NVML included), whatever the prefix.
    samples = await run_in_threadpool(service.samples, "traind_")
    context = {"page": "hardware", "hw": hardware_view(samples)}
    return _page(request, templates, "hardware", context, fragment)


@router.get("/comm", include_in_schema=False)
async def comm_page(
    request: Request, service: ServiceDep, templates: TemplatesDep, fragment: bool = False
) -> HTMLResponse:
    samples = await run_in_threadpool(service.samples, "traind_comm_")
    context = {"page": "comm", "comm": comm_view(samples)}
    return _page(request, templates, "comm", context, fragment)


def _page(
    request: Request, templates: Jinja2Templates, name: str, context: dict[str, Any], fragment: bool
) -> HTMLResponse:
    """The whole page, or only its panel (``<name>_panel.html``) for the 5 s refresh."""
    template = f"{name}_panel.html" if fragment else f"{name}.html"
    return templates.TemplateResponse(request, template, context)
