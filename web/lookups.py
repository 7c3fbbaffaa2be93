"""What the API routers and the pages share about a resource they look up by id.

A route that takes an id answers 404 when the service has no such item; the JSON API and the
HTML pages ask the same question, so the lookup and the OpenAPI description of its answer live
here, beside the 401 every state-changing API call may return. The routers import this module
and never each other (tests/test_architecture.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import HTTPException, status
from starlette.concurrency import run_in_threadpool

from traind.daemon.service import ProfileRefused
from traind.web.errors import unprocessable
from traind.web.schemas import ErrorOut

if TYPE_CHECKING:
    from traind.daemon.service import (
        AutotuneInfo,
        Capture,
        ExperimentInfo,
        NodeService,
        RunDetail,
    )

# FastAPI's ``responses=`` argument: extra status codes for the OpenAPI document.
Responses = dict[int | str, dict[str, Any]]
AUTH: Responses = {401: {"model": ErrorOut, "description": "Missing or wrong token."}}
ENDED: Responses = {409: {"model": ErrorOut, "description": "It had already ended."}}
EXPERIMENT_MISSING: Responses = {404: {"model": ErrorOut, "description": "No such experiment."}}
RUN_MISSING: Responses = {404: {"model": ErrorOut, "description": "No such run."}}
AUTOTUNE_MISSING: Responses = {404: {"model": ErrorOut, "description": "No such search."}}
CAPTURE_MISSING: Responses = {404: {"model": ErrorOut,
                                    "description": "No such run or capture."}}


async def get_experiment(service: NodeService, experiment_id: int) -> ExperimentInfo:
    """The experiment, or 404 (EXPERIMENT_MISSING)."""
    info = await run_in_threadpool(service.experiment, experiment_id)
    if info is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no experiment {experiment_id}")
    return info


async def get_autotune(service: NodeService, tune_id: int) -> AutotuneInfo:
    """The search, or 404 (AUTOTUNE_MISSING)."""
    info = await run_in_threadpool(service.autotune, tune_id)
    if info is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no auto-tune search {tune_id}")
    return info


async def get_run_detail(service: NodeService, run_id: int) -> RunDetail:
    """The run for its page, or 404 (RUN_MISSING)."""
    detail = await run_in_threadpool(service.run_detail, run_id)
    if detail is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return detail


async def ask_profile(service: NodeService, run_id: int, *, steps: int,
                      ranks: list[int] | None) -> Capture:
    """Ask the running run for a profile: the capture, or 404 (no run), 409 (not running
    here, or a capture under way), 422 naming the field (a rank the job lacks)."""
    detail = await get_run_detail(service, run_id)
    try:
        capture = await service.request_profile(run_id, steps=steps, ranks=ranks)
    except ProfileRefused as exc:
        if exc.conflict:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
        raise unprocessable(exc) from None
    if capture is None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"run {run_id} is not running on "
                            f"this node ({detail.run.state})")
    return capture


async def get_profile(service: NodeService, run_id: int, capture: int
                      ) -> tuple[Capture, dict[str, Any] | None]:
    """A capture and its report (None until built), or 404 (CAPTURE_MISSING)."""
    found = await run_in_threadpool(service.profile, run_id, capture)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no capture {capture} of run {run_id}")
    return found
