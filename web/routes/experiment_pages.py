"""Experiment pages: the list with the "New experiment" and "Auto-tune" forms, the queue and
the searches, and one experiment's verdict.

The browser does not hold the daemon's token: the form routes take a session and its CSRF
token instead (web/forms.py). A rejected form is shown again with each error beside its field;
nothing is queued then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from traind.daemon.service import PAGE
from traind.web.autotune_views import autotune_row, queue_rows
from traind.web.deps import IdPath, ServiceDep, TemplatesDep, require_reader
from traind.web.errors import field_errors
from traind.web.forms import check_form
from traind.web.routes.experiments import get_experiment
from traind.web.schemas import METHODS, TUNE_PRECISIONS, ExperimentIn
from traind.web.views import experiment_row, verdict_chart

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from fastapi.templating import Jinja2Templates

    from traind.daemon.service import NodeService

# Reading pages may be closed to anyone without a session (daemon.open_pages).
router = APIRouter(default_response_class=HTMLResponse, dependencies=[Depends(require_reader)])

ARMS = 2  # the form's arms: a baseline and one candidate (the API takes more)
PRECISIONS = ("", "fp32", "bf16")  # "": the base config's
# The auto-tune form's first values: the daemon's defaults (see AutotuneSpec).
TUNE_DEFAULTS: dict[str, Any] = {
    "name": "", "precisions": ["fp32", "bf16"], "methods": ["none", "int8"], "steps": "200",
    "max_rounds": "3", "target_run": ""}
DEFAULTS = {"name": "", "steps": "400", "block_steps": "20",
            "arm0_name": "", "arm0_method": "none", "arm0_precision": "",
            "arm1_name": "", "arm1_method": "int8", "arm1_precision": ""}


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
        "block_steps": values["block_steps"], "arms": arms,
    }, strict=False)


def form_field(loc: Sequence[Any]) -> str | None:
    """The form input an error location belongs to (API body or daemon config path), if any:
    ``("arms", 1, "precision")`` -> ``arm1``, ``("interleave", "block_steps")`` ->
    ``block_steps``."""
    parts = [p for p in loc if p != "body"]
    for k, part in enumerate(parts[:-1]):
        if part == "arms" and isinstance(parts[k + 1], int) and 0 <= parts[k + 1] < ARMS:
            return f"arm{parts[k + 1]}"
    for field in ("block_steps", "steps", "name"):
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


async def submit_or_show_errors(
    parse: Callable[[], Any], submit: Callable[[Any], Awaitable[Any]],
    errors: Callable[[list[dict[str, Any]]], Awaitable[Response]], url: Callable[[Any], str],
) -> Response:
    """A form's post: ``parse`` it into the API's body (a ValidationError names body fields),
    ``submit`` that to the service (a ValueError names config fields), then redirect to
    ``url(result)``; either error shows the form again through ``errors(items)``."""
    try:
        body = parse()
    except ValidationError as exc:
        return await errors([{"loc": e["loc"], "msg": e["msg"]} for e in exc.errors()])
    try:
        result = await submit(body)
    except ValueError as exc:
        return await errors(field_errors(exc))
    return RedirectResponse(url(result), status_code=status.HTTP_303_SEE_OTHER)


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
    context = {"page": "experiments", "e": experiment_row(info), "chart": verdict_chart(info)}
    return templates.TemplateResponse(request, "experiment.html", context)


@router.post("/experiments/{experiment_id}/cancel", include_in_schema=False)
async def cancel_form(experiment_id: IdPath, request: Request, service: ServiceDep) -> Response:
    check_form(request, await request.form())
    await get_experiment(service, experiment_id)
    # Already ended: nothing to do, and the page it returns to shows the final state.
    await service.cancel_experiment(experiment_id)
    return RedirectResponse(f"/experiments/{experiment_id}",
                            status_code=status.HTTP_303_SEE_OTHER)


async def render_list(
    request: Request, service: NodeService, templates: Jinja2Templates, *,
    values: Mapping[str, str] = DEFAULTS, errors: dict[str, list[str]] | None = None,
    tune: Mapping[str, Any] | None = None, tune_errors: dict[str, list[str]] | None = None,
    queue_error: str | None = None,
) -> HTMLResponse:
    """The experiments page: both forms (either one shown again with its errors, status 422),
    the waiting trials (with a refused reorder's reason), the searches and the experiments."""
    # One page of each list (PAGE items): the page's size and render time do not grow with
    # the data; the rest is one API call away (limit/offset).
    infos, tunes, trials, runs = await run_in_threadpool(
        lambda: (service.experiments(limit=PAGE), service.autotunes(limit=PAGE),
                 service.queued_trials(limit=PAGE + 1), service.runs(limit=PAGE)))
    queue_more = len(trials) > PAGE
    trials = trials[:PAGE]
    errors, tune_errors = errors or {}, tune_errors or {}
    context = {
        "page": "experiments", "rows": [experiment_row(e) for e in infos],
        "form": values, "errors": errors,
        "methods": METHODS, "precisions": PRECISIONS, "arm_count": ARMS,
        "tune": TUNE_DEFAULTS if tune is None else tune, "tune_errors": tune_errors,
        "tune_precisions": TUNE_PRECISIONS,
        "running_runs": [(r.id, r.name) for r in runs if r.state == "running"],
        "tunes": [autotune_row(t) for t in tunes], "queue": queue_rows(trials),
        "queue_more": queue_more, "page_size": PAGE,
        "queue_error": queue_error,
    }
    failed = errors or tune_errors or queue_error
    code = status.HTTP_422_UNPROCESSABLE_CONTENT if failed else status.HTTP_200_OK
    return templates.TemplateResponse(request, "experiments.html", context, status_code=code)
