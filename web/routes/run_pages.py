"""One run's page (``/runs/{id}``) and runs compared (``/runs/compare?ids=..``).

A run's page: its header, charts, config, events, experiments, promotions and log tail, and a
confirmed stop. Live while it trains, whole after it ended and
after a daemon restart: the charts draw the series the daemon stored (static/run.js fetches
/api/runs/{id}/series), not the hub's in-memory buffer.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from traind.contracts.control import PROFILE_STEPS_MAX
from traind.web.autotune_views import promotion_row
from traind.web.deps import IdPath, ServiceDep, TemplatesDep, require_reader
from traind.web.errors import unprocessable
from traind.web.forms import check_form
from traind.web.lookups import ask_profile, get_profile, get_run_detail
from traind.web.profileviews import capture_row, profile_fields, profile_view
from traind.web.runviews import (
    COMPARE_MAX,
    PALETTE,
    compare_ids,
    config_differences,
    legend_names,
    run_page,
)
from traind.web.schemas import INT64_MAX
from traind.web.views import run_row, utcnow

# Reading pages may be closed to anyone without a session (daemon.open_pages).
router = APIRouter(default_response_class=HTMLResponse, dependencies=[Depends(require_reader)])


@router.get("/runs/compare", include_in_schema=False)
async def compare_page(request: Request, service: ServiceDep, templates: TemplatesDep,
                       ids: Annotated[list[Annotated[int, Field(ge=1, le=INT64_MAX)]],
                                    Query(max_length=COMPARE_MAX * 4)]
                       ) -> HTMLResponse:
    """Runs overlaid in every chart, a colour each, under a table of the settings in which
    their configs differ. Before ``/runs/{id}``, which would take "compare" for an id."""
    try:
        chosen = compare_ids(ids)
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=[
            {"loc": ["query", "ids"], "msg": str(exc), "type": "value_error"}]) from None
    details = [await get_run_detail(service, i) for i in chosen]
    differences = config_differences([d.config for d in details])
    now = utcnow()
    context = {"page": "runs", "runs": [run_row(d.run, now) for d in details],
               "colors": PALETTE,
               "names": json.dumps(legend_names([(d.run.id, d.run.name) for d in details],
                                                differences)),
               "differences": differences}
    return templates.TemplateResponse(request, "compare.html", context)


@router.get("/runs/{run_id}", include_in_schema=False)
async def run_page_route(run_id: IdPath, request: Request, service: ServiceDep,
                         templates: TemplatesDep) -> HTMLResponse:
    detail = await get_run_detail(service, run_id)
    promotions = await run_in_threadpool(service.promotions, run_id)
    captures = await run_in_threadpool(service.profiles, run_id)
    context = {"page": "runs", "r": run_page(detail, utcnow()), "colors": PALETTE,  # ranks'
               "promotions": [promotion_row(p) for p in promotions],
               "profiles": [capture_row(c) for c in captures or ()],
               "profile_steps_max": PROFILE_STEPS_MAX}
    return templates.TemplateResponse(request, "run.html", context)


@router.post("/runs/{run_id}/probe-links", include_in_schema=False)
async def probe_links_form(run_id: IdPath, request: Request, service: ServiceDep) -> Response:
    """The /comm links panel's "Measure again": back to the panel, which shows the new matrix
    once the job reaches its next report step."""
    check_form(request, await request.form())
    await get_run_detail(service, run_id)
    await service.probe_links(run_id)  # not running here (any more): nothing to do
    return RedirectResponse("/comm#links", status_code=status.HTTP_303_SEE_OTHER)


@router.post("/runs/{run_id}/profile", include_in_schema=False)
async def profile_form(run_id: IdPath, request: Request, service: ServiceDep) -> Response:
    """The run page's "Profile": on to the capture's report page, which reloads until the
    report is ready."""
    form = await request.form()
    check_form(request, form)
    try:
        steps, ranks = profile_fields(form.get("steps"), form.get("ranks"))
    except ValueError as exc:
        raise unprocessable(exc) from None
    capture = await ask_profile(service, run_id, steps=steps, ranks=ranks)
    return RedirectResponse(f"/runs/{run_id}/profiles/{capture.capture}",
                            status_code=status.HTTP_303_SEE_OTHER)


@router.get("/runs/{run_id}/profiles/{capture}", include_in_schema=False)
async def profile_page(run_id: IdPath, capture: IdPath, request: Request, service: ServiceDep,
                       templates: TemplatesDep) -> HTMLResponse:
    found, body = await get_profile(service, run_id, capture)
    return templates.TemplateResponse(request, "profile.html",
                                      {"page": "runs", "p": profile_view(found, body)})


@router.post("/runs/{run_id}/stop", include_in_schema=False)
async def stop_form(run_id: IdPath, request: Request, service: ServiceDep) -> Response:
    check_form(request, await request.form())
    await get_run_detail(service, run_id)
    # Not running here (any more): nothing to do; the page shows the state it has.
    await service.stop_run(run_id)
    return RedirectResponse(f"/runs/{run_id}", status_code=status.HTTP_303_SEE_OTHER)
