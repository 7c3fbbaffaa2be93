"""JSON API for auto-tuning searches, the promotions they lead to, and the trial queue.

Every POST needs the daemon's token (see deps.TokenDep), as the experiments' routes do; a
rejected body is a 422 naming each field, and nothing is stored or reordered then.
``traind experiments autotune*`` is a client of these routes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from starlette.concurrency import run_in_threadpool

from traind.daemon.service import PAGE
from traind.web.deps import IdPath, Limit, Offset, ServiceDep, TokenDep
from traind.web.errors import field_errors, unprocessable
from traind.web.limits import OffLoopJSONRoute
from traind.web.lookups import AUTH, AUTOTUNE_MISSING, ENDED, get_autotune
from traind.web.schemas import (
    INT64_MAX,
    AutotuneIn,
    AutotuneOut,
    PromotionOut,
    QueuedTrialOut,
    ReorderIn,
)

router = APIRouter(prefix="/api", route_class=OffLoopJSONRoute)


@router.post("/autotunes", status_code=status.HTTP_201_CREATED, response_model=AutotuneOut,
             responses=AUTH, tags=["autotunes"])
async def submit(body: AutotuneIn, service: ServiceDep, _auth: TokenDep) -> AutotuneOut:
    """Validate, record and start a search; 422 names each bad field (nothing stored)."""
    try:
        info = await service.submit_autotune(body.spec())
    except ValueError as exc:
        raise unprocessable(exc) from None
    return AutotuneOut.of(info)


# Sync ``def`` routes run in the threadpool: the service reads the database.
@router.get("/autotunes", response_model=list[AutotuneOut], tags=["autotunes"])
def list_autotunes(service: ServiceDep, limit: Limit = PAGE, offset: Offset = 0
                   ) -> list[AutotuneOut]:
    """One page of searches, newest first."""
    return [AutotuneOut.of(t) for t in service.autotunes(limit=limit, offset=offset)]


@router.get("/autotunes/{tune_id}", response_model=AutotuneOut, responses=AUTOTUNE_MISSING,
            tags=["autotunes"])
async def show(tune_id: IdPath, service: ServiceDep) -> AutotuneOut:
    """One search with its rounds so far, the candidates left out and the best setting."""
    return AutotuneOut.of(await get_autotune(service, tune_id))


@router.post("/autotunes/{tune_id}/cancel", response_model=AutotuneOut,
             responses={**AUTH, **AUTOTUNE_MISSING, **ENDED},
             tags=["autotunes"])
async def cancel(tune_id: IdPath, service: ServiceDep, _auth: TokenDep) -> AutotuneOut:
    """Stop the search and the experiment of its current round."""
    await get_autotune(service, tune_id)
    if not await service.cancel_autotune(tune_id):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"auto-tune search {tune_id} has already ended")
    return AutotuneOut.of(await get_autotune(service, tune_id))


@router.get("/promotions", response_model=list[PromotionOut], tags=["promotions"])
def list_promotions(
    service: ServiceDep,
    run_id: Annotated[int | None, Query(ge=1, le=INT64_MAX, description="Only this run's.")]
    = None,
    limit: Limit = PAGE, offset: Offset = 0,
) -> list[PromotionOut]:
    """Tuned settings handed to running jobs, newest first (one page): state, setting, the
    previous one, the evidence, and why one was rolled back."""
    return [PromotionOut.of(p) for p in service.promotions(run_id, limit=limit, offset=offset)]


@router.get("/queue", response_model=list[QueuedTrialOut], tags=["queue"])
def queue(service: ServiceDep, limit: Limit = PAGE, offset: Offset = 0
          ) -> list[QueuedTrialOut]:
    """One page of the trials waiting to be claimed, in claim order."""
    return [QueuedTrialOut.of(t) for t in service.queued_trials(limit=limit, offset=offset)]


@router.post("/queue/reorder", response_model=list[QueuedTrialOut], responses=AUTH,
             tags=["queue"])
async def reorder(body: ReorderIn, service: ServiceDep, _auth: TokenDep) -> list[QueuedTrialOut]:
    """Claim these waiting trials in this order; 422 for an id that is not a waiting trial
    (nothing changes then). Returns the queue as it is now."""
    try:
        await run_in_threadpool(service.reorder_trials, body.trial_ids)
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            detail=reorder_errors(exc)) from None
    return [QueuedTrialOut.of(t) for t in await run_in_threadpool(service.queued_trials)]


def reorder_errors(exc: ValueError) -> list[dict[str, object]]:
    """The queue names its parameter ``trial_ids_in_order``; the body calls it ``trial_ids``
    (and a refusal that names no field is about the ids all the same)."""
    items = field_errors(exc)
    for item in items:
        loc = item["loc"]
        if len(loc) > 1 and loc[1] == "trial_ids_in_order":
            item["loc"] = ["body", "trial_ids", *loc[2:]]
        elif loc == ["body"]:
            item["loc"] = ["body", "trial_ids"]
    return items
