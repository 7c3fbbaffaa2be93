"""Server-rendered HTML pages: the live overview, the runs table, hardware and communication.

The hardware and communication pages refresh by fetching themselves with ``?fragment=1``: the
server renders the same panel template it embeds in the full page, so units are formatted in
one place (traind.web.views) and the browser only swaps HTML (static/refresh.js). Their charts
over time come in the panel too, as JSON (traind.web.historyviews), for static/history.js.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from traind.contracts.states import RUN_STATES
from traind.daemon.service import (
    CONFIG_FILTER_MAX,
    CONFIG_KEY_PATTERN,
    PAGE,
    PromotionView,
    RunView,
)
from traind.web.autotune_views import PromotionRow, promotion_row
from traind.web.deps import RunParam, RunQueryDep, ServiceDep, TemplatesDep, require_reader
from traind.web.historyviews import comm_history_view, hardware_history_view
from traind.web.linkviews import links_view
from traind.web.nodeviews import comm_view, hardware_view
from traind.web.runviews import RUN_COLUMNS, pages, runs_href, sort_href
from traind.web.views import current_run, overview_choices, run_row, utcnow

if TYPE_CHECKING:
    from fastapi.templating import Jinja2Templates

# Reading pages may be closed to anyone without a session (daemon.open_pages).
router = APIRouter(default_response_class=HTMLResponse, dependencies=[Depends(require_reader)])


@router.get("/", include_in_schema=False)
async def overview(request: Request, service: ServiceDep, templates: TemplatesDep,
                   run: RunParam = None) -> HTMLResponse:
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
async def runs_page(request: Request, service: ServiceDep, templates: TemplatesDep,
                    query: RunQueryDep, page: Annotated[int, Query(ge=1, le=10**9)] = 1
                    ) -> HTMLResponse:
    """The runs table, a page of PAGE rows: filtered by state, name, experiment and a config
    key's value, sorted by any figure column (the headings' links), paged through with the
    pager's."""
    def read() -> tuple[list[RunView], int, list[PromotionView]]:
        return (service.runs(limit=PAGE, offset=(page - 1) * PAGE, query=query),
                service.count_runs(query), service.promotions())

    runs, total, promotions = await run_in_threadpool(read)
    now = utcnow()
    by_run: dict[int, list[PromotionRow]] = {}
    for p in promotions:  # newest first, as under each run
        by_run.setdefault(p.run_id, []).append(promotion_row(p))
    last = pages(total, PAGE)
    context = {"page": "runs", "rows": [run_row(r, now) for r in runs], "promotions": by_run,
               "total": total, "query": query, "states": RUN_STATES,
               "config_pattern": CONFIG_KEY_PATTERN, "config_max": CONFIG_FILTER_MAX,
               "columns": [(title, sort_href(query, key) if key else None,
                            key == query.sort, num) for title, key, num in RUN_COLUMNS],
               "page_no": page, "pages": last,
               "prev": runs_href(query, page - 1) if page > 1 else None,
               "next": runs_href(query, page + 1) if page < last else None}
    return templates.TemplateResponse(request, "runs.html", context)


@router.get("/hardware", include_in_schema=False)
async def hardware_page(
    request: Request, service: ServiceDep, templates: TemplatesDep, fragment: bool = False
) -> HTMLResponse:
    # One collection for host, process and GPU series: every samples() call runs every
    # collector (NVML included), whatever the prefix.
    samples = await run_in_threadpool(service.samples, "traind_")
    # In memory, mutated on the loop: read on the loop (as /api/hardware/history).
    context = {"page": "hardware", "hw": hardware_view(samples),
               "history": hardware_history_view(service.hardware_history())}
    return _page(request, templates, "hardware", context, fragment)


@router.get("/comm", include_in_schema=False)
async def comm_page(
    request: Request, service: ServiceDep, templates: TemplatesDep, fragment: bool = False
) -> HTMLResponse:
    # every samples() call runs every collector: one call for comm_ and link_ series
    samples = await run_in_threadpool(service.samples, "traind_")
    comm = comm_view(samples)
    # The run the totals show, over time (in memory, read on the loop).
    history = service.comm_history(int(comm.run) if comm.run and comm.run.isdigit() else None)
    context = {"page": "comm", "comm": comm, "history": comm_history_view(history),
               "links": links_view(samples)}
    return _page(request, templates, "comm", context, fragment)


def _page(
    request: Request, templates: Jinja2Templates, name: str, context: dict[str, Any], fragment: bool
) -> HTMLResponse:
    """The whole page, or only its panel (``<name>_panel.html``) for the 5 s refresh."""
    template = f"{name}_panel.html" if fragment else f"{name}.html"
    return templates.TemplateResponse(request, template, context)
