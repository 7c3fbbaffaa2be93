"""The experiments page as both of its forms draw it, and the post handling they share.

/experiments holds the "New experiment" form, the "Auto-tune" form and the queue's buttons; a
rejected post of any of them shows this same page again (status 422) with its errors. The
experiment and auto-tune routers both need that page and the parse-submit-redirect step, and
routers never import each other (tests/test_architecture.py), so both live here. The form
fields' first values live here too: the page draws them when nothing was posted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from traind.daemon.service import EXPERIMENT_STEPS, PAGE, TUNE_STEPS
from traind.web.autotune_views import autotune_row, queue_rows
from traind.web.errors import field_errors
from traind.web.schemas import METHODS, TUNE_PRECISIONS
from traind.web.views import band_cost, experiment_row

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from fastapi import Request
    from fastapi.templating import Jinja2Templates

    from traind.daemon.service import ExperimentInfo, NodeService

ARMS = 2  # the form's arms: a baseline and one candidate (the API takes more)
PRECISIONS = ("", "fp32", "bf16")  # "": the base config's
# The auto-tune form's first values: the daemon's defaults (see AutotuneSpec).
TUNE_DEFAULTS: dict[str, Any] = {
    "name": "", "precisions": ["fp32", "bf16"], "methods": ["none", "int8"],
    "steps": str(TUNE_STEPS), "max_rounds": "3", "target_run": "", "mesh": False}
DEFAULTS = {"name": "", "steps": str(EXPERIMENT_STEPS), "block_steps": "20",
            "min_effect": "0.02",
            "equivalence": "",  # empty: auto, the band the budget reaches at the noise
            "arm0_name": "", "arm0_method": "none", "arm0_precision": "",
            "arm1_name": "", "arm1_method": "int8", "arm1_precision": ""}


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
        "form": values, "errors": errors, "band_cost": _band_cost(infos, values),
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


def _band_cost(infos: list[ExperimentInfo], values: Mapping[str, str]) -> str | None:
    """The form's band as it costs here, or the band auto would choose (views.band_cost),
    from the values as typed."""
    try:
        typed = values["equivalence"].strip()
        band = float(typed) if typed else None
        block_steps, steps = int(values["block_steps"]), int(values["steps"])
    except (KeyError, ValueError):
        return None
    return band_cost(infos, band=band, block_steps=block_steps, steps=steps, arms=ARMS)
