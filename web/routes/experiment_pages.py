"""Experiment pages: the list with the "New experiment" and "Auto-tune" forms, the queue and
the searches (drawn by web/form_pages.py), and one experiment's verdict.

The browser does not hold the daemon's token: the form routes take a session and its CSRF
token instead (web/forms.py). A rejected form is shown again with each error beside its field;
nothing is queued then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from traind.daemon.service import RunQuery
from traind.web.deps import IdPath, ServiceDep, TemplatesDep, require_reader
from traind.web.experimentviews import (
    blocks_chart,
    interval_note,
    mean_rows,
    progress_label,
    progress_percent,
)
from traind.web.form_pages import ARMS, DEFAULTS, render_list, submit_or_show_errors
from traind.web.forms import check_form
from traind.web.lookups import get_experiment
from traind.web.runviews import runs_href
from traind.web.schemas import ExperimentIn
from traind.web.views import experiment_row, verdict_chart

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# Reading pages may be closed to anyone without a session (daemon.open_pages).
router = APIRouter(default_response_class=HTMLResponse, dependencies=[Depends(require_reader)])

def arm_name(name: str, method: str, precision: str, taken: Sequence[str]) -> str:
    """The arm's name as typed, else its method (and precision): ``int8``, ``none-bf16``;
    made unique against the arms before it."""
    base = name.strip() or "-".join(p for p in (method or "none", precision) if p)
    out, n = base, 2
    while out in taken:
        out, n = f"{base}-{n}", n + 1
    return out


def experiment_from_form(values: Mapping[str, str]) -> ExperimentIn:
    """The form as the API's request body; ``ValidationError`` locs name body fields."""
    arms: list[dict[str, Any]] = []
    for i in range(ARMS):
        method, precision = values[f"arm{i}_method"], values[f"arm{i}_precision"]
        name = arm_name(values[f"arm{i}_name"], method, precision, [a["name"] for a in arms])
        arms.append({"name": name, "compression": {"method": method} if method else {},
                     "precision": precision or None})
    return ExperimentIn.model_validate({
        "name": values["name"].strip(), "steps": values["steps"],
        "block_steps": values["block_steps"], "min_effect": values["min_effect"],
        "equivalence": values["equivalence"].strip() or None, "arms": arms,
    }, strict=False)


def form_field(loc: Sequence[Any]) -> str | None:
    """The form input an error location belongs to (API body or daemon config path), if any:
    ``("arms", 1, "precision")`` -> ``arm1``, ``("interleave", "block_steps")`` ->
    ``block_steps``."""
    parts = [p for p in loc if p != "body"]
    for k, part in enumerate(parts[:-1]):
        if part == "arms" and isinstance(parts[k + 1], int) and 0 <= parts[k + 1] < ARMS:
            return f"arm{parts[k + 1]}"
    for field in ("block_steps", "min_effect", "equivalence", "steps", "name"):
        if (parts and parts[-1] == field) or (field != "name" and field in parts):
            return field
    return None


def errors_by_field(items: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Error items ({"loc", "msg"}) grouped by form input; "" holds the rest, each with the
    field it names (there is no input beside which to show it)."""
    out: dict[str, list[str]] = {}
    for item in items:
        field = form_field(item["loc"])
        where = ".".join(str(p) for p in item["loc"] if p != "body")
        msg = str(item["msg"]) if field or not where else f"{where}: {item['msg']}"
        out.setdefault(field or "", []).append(msg)
    return out


@router.get("/experiments", include_in_schema=False)
async def experiments_page(
    request: Request, service: ServiceDep, templates: TemplatesDep
) -> HTMLResponse:
    return await render_list(request, service, templates)


@router.post("/experiments", include_in_schema=False)
async def submit_form(request: Request, service: ServiceDep, templates: TemplatesDep) -> Response:
    form = await request.form()
    check_form(request, form)
    values = {k: str(form.get(k, v)) for k, v in DEFAULTS.items()}

    async def show(items: list[dict[str, Any]]) -> Response:
        return await render_list(request, service, templates, values=values,
                                 errors=errors_by_field(items))

    return await submit_or_show_errors(
        lambda: experiment_from_form(values), lambda b: service.submit_experiment(b.spec()),
        show, lambda info: f"/experiments/{info.id}")


@router.get("/experiments/{experiment_id}", include_in_schema=False)
async def experiment_page(
    experiment_id: IdPath, request: Request, service: ServiceDep, templates: TemplatesDep
) -> HTMLResponse:
    info = await get_experiment(service, experiment_id)
    evidence = await run_in_threadpool(service.experiment_evidence, experiment_id)
    context: dict[str, Any] = {"page": "experiments", "e": experiment_row(info),
                               "chart": verdict_chart(info), "interval_note": interval_note(info),
                               "runs_href": runs_href(RunQuery(experiment=experiment_id))}
    if evidence is not None:
        context |= {"means": mean_rows(evidence),
                    "progress": progress_label(evidence.progress),
                    "progress_pct": progress_percent(evidence.progress),
                    "blocks": blocks_chart(info, evidence)}
    return templates.TemplateResponse(request, "experiment.html", context)


@router.post("/experiments/{experiment_id}/cancel", include_in_schema=False)
async def cancel_form(experiment_id: IdPath, request: Request, service: ServiceDep) -> Response:
    check_form(request, await request.form())
    await get_experiment(service, experiment_id)
    # Already ended: nothing to do, and the page it returns to shows the final state.
    await service.cancel_experiment(experiment_id)
    return RedirectResponse(f"/experiments/{experiment_id}",
                            status_code=status.HTTP_303_SEE_OTHER)
