"""Auto-tune pages: the "Auto-tune" form and the queue's buttons on /experiments, and one
search's rounds, left-out candidates and promotions.

The same guards as the experiment form (web/forms.py): a session, its CSRF token and a
same-origin post; a rejected form is shown again with each error beside its input, and nothing
is stored or reordered then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from traind.daemon.autotune.mesh import LABELLED
from traind.errors import FieldErrors, line
from traind.web.autotune_views import autotune_row, promotion_row
from traind.web.deps import IdPath, ServiceDep, TemplatesDep, require_reader
from traind.web.form_pages import TUNE_DEFAULTS, render_list, submit_or_show_errors
from traind.web.forms import check_form
from traind.web.lookups import get_autotune
from traind.web.schemas import TUNE_PRECISIONS, AutotuneIn

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# Reading pages may be closed to anyone without a session (daemon.open_pages).
router = APIRouter(default_response_class=HTMLResponse, dependencies=[Depends(require_reader)])

# API body fields -> the form's inputs (the rest are shown above the form with their path).
_INPUTS = {"name": "name", "precisions": "precisions", "compressions": "methods",
           "steps": "steps", "max_rounds": "max_rounds", "target_run_id": "target_run",
           "mesh": "mesh"}


def tune_values(form: Any) -> dict[str, Any]:
    """The form's inputs as typed (checkbox groups as lists), to build the body or refill it."""
    return {
        "name": str(form.get("name", "")),
        "precisions": [str(v) for v in form.getlist("precision")],
        "methods": [str(v) for v in form.getlist("method")],
        "steps": str(form.get("steps", TUNE_DEFAULTS["steps"])),
        "max_rounds": str(form.get("max_rounds", TUNE_DEFAULTS["max_rounds"])),
        "target_run": str(form.get("target_run", "")),
        "mesh": form.get("mesh") is not None,  # a checkbox: sent only when ticked
    }


def autotune_from_form(values: Mapping[str, Any]) -> AutotuneIn:
    """The form as the API's body; ``ValidationError`` locs name body fields. ``none`` is
    added when unticked: the daemon always includes it (it is the baseline)."""
    methods = list(dict.fromkeys(["none", *values["methods"]]))
    return AutotuneIn.model_validate({
        "name": values["name"].strip(), "precisions": values["precisions"],
        "compressions": [{"method": m} for m in methods], "steps": values["steps"],
        "max_rounds": values["max_rounds"], "target_run_id": values["target_run"] or None,
        "mesh": bool(values.get("mesh")),
    }, strict=False)


def tune_field(loc: Sequence[Any]) -> str | None:
    """The input an error belongs to: a body field (``("precisions", 0)`` -> precisions) or
    a candidate the daemon could not configure (``("fp32.int8", "compression", ...)`` ->
    methods; ``("bf16.none", ...)`` -> precisions; ``("bf16.none", "steps")``, a round too short
    for two pairs -> steps)."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    if isinstance(parts[0], str) and parts[0] in _INPUTS:
        return _INPUTS[parts[0]]
    if parts[1:] == ["steps"]:  # a candidate's round cannot hold two pairs: the budget's fault
        return "steps"
    if str(parts[0]).startswith("the mesh stage") or str(parts[0]) == "mesh":
        return "mesh"
    precision, dot, rest = str(parts[0]).partition(".")
    if precision in TUNE_PRECISIONS and LABELLED.search(str(parts[0])):
        return "mesh"  # a mesh candidate: <precision>.none.dp2tp2
    if precision in TUNE_PRECISIONS:  # a candidate's name: <precision>.<method>[-params]
        rest = rest or (str(parts[1]) if len(parts) > 1 else "")
        if dot or len(parts) > 1:
            return "precisions" if rest.split("-")[0].split(".")[0] == "none" else "methods"
    return None


def tune_errors(items: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Error items grouped by input; a message about a candidate keeps the candidate's name
    ("fp32.int8: ...") so the box it sits beside says which one; "" holds the rest."""
    out: dict[str, list[str]] = {}
    for item in items:
        field = tune_field(item["loc"])
        parts = [str(p) for p in item["loc"] if p != "body"]
        named = field is None or (parts and parts[0] not in _INPUTS)
        where = ".".join(parts)
        msg = f"{where}: {item['msg']}" if named and where else str(item["msg"])
        out.setdefault(field or "", []).append(msg)
    return out


@router.post("/autotunes", include_in_schema=False)
async def submit_form(request: Request, service: ServiceDep, templates: TemplatesDep) -> Response:
    form = await request.form()
    check_form(request, form)
    values = tune_values(form)

    async def show(items: list[dict[str, Any]]) -> Response:
        return await render_list(request, service, templates, tune=values,
                                 tune_errors=tune_errors(items))

    return await submit_or_show_errors(
        lambda: autotune_from_form(values), lambda b: service.submit_autotune(b.spec()),
        show, lambda info: f"/autotunes/{info.id}")


@router.get("/autotunes/{tune_id}", include_in_schema=False)
async def autotune_page(
    tune_id: IdPath, request: Request, service: ServiceDep, templates: TemplatesDep
) -> HTMLResponse:
    info = await get_autotune(service, tune_id)
    promotions = [] if info.target_run_id is None else await run_in_threadpool(
        service.promotions, info.target_run_id)
    context = {"page": "experiments", "t": autotune_row(info),
               "promotions": [promotion_row(p) for p in promotions]}
    return templates.TemplateResponse(request, "autotune.html", context)


@router.post("/autotunes/{tune_id}/cancel", include_in_schema=False)
async def cancel_form(tune_id: IdPath, request: Request, service: ServiceDep) -> Response:
    check_form(request, await request.form())
    await get_autotune(service, tune_id)
    # Already ended: nothing to do, and the page it returns to shows the final state.
    await service.cancel_autotune(tune_id)
    return RedirectResponse(f"/autotunes/{tune_id}", status_code=status.HTTP_303_SEE_OTHER)


@router.post("/queue/reorder", include_in_schema=False)
async def reorder_form(request: Request, service: ServiceDep, templates: TemplatesDep) -> Response:
    """An "up" or "down" button: the whole new order, as repeated ``trial_ids``."""
    form = await request.form()
    check_form(request, form)
    try:
        ids = [int(str(v)) for v in form.getlist("trial_ids")]
        if not ids:
            raise FieldErrors.at(("trial_ids",), "give the new order")
        await run_in_threadpool(service.reorder_trials, ids)
    except ValueError as exc:
        # Say why (a trial claimed since the page was drawn, say) above the queue as it is now;
        # a refusal that names no field (a bad number) is about the ids all the same.
        message = "; ".join(line(loc or ("trial_ids",), msg)
                            for loc, msg in FieldErrors.of(exc).errors)
        return await render_list(request, service, templates, queue_error=message)
    return RedirectResponse("/experiments#queue", status_code=status.HTTP_303_SEE_OTHER)
