"""JSON API for A/B experiments: submit, list, show, cancel, export the verdict.

Every POST needs the daemon's token (``Authorization: Bearer <token>``, see deps.TokenDep);
reads stay open like the rest of the API. ``traind experiments`` is a client of these routes.
"""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from traind.daemon.service import PAGE
from traind.web.deps import IdPath, Limit, Offset, ServiceDep, TokenDep
from traind.web.errors import unprocessable
from traind.web.limits import OffLoopJSONRoute
from traind.web.schemas import ErrorOut, ExperimentIn, ExperimentOut, VerdictRow
from traind.web.views import VERDICT_FIELDS, verdict_rows

if TYPE_CHECKING:
    from traind.daemon.service import ExperimentInfo, NodeService

router = APIRouter(prefix="/api/experiments", tags=["experiments"], route_class=OffLoopJSONRoute)

Responses = dict[int | str, dict[str, Any]]
_AUTH: Responses = {401: {"model": ErrorOut, "description": "Missing or wrong token."}}
_MISSING: Responses = {404: {"model": ErrorOut, "description": "No such experiment."}}

async def get_experiment(service: NodeService, experiment_id: int) -> ExperimentInfo:
    info = await run_in_threadpool(service.experiment, experiment_id)
    if info is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no experiment {experiment_id}")
    return info


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ExperimentOut,
             responses=_AUTH)
async def submit(body: ExperimentIn, service: ServiceDep, _auth: TokenDep) -> ExperimentOut:
    """Validate, record and start an experiment; 422 names each bad field (nothing queued)."""
    try:
        info = await service.submit_experiment(body.spec())
    except ValueError as exc:
        raise unprocessable(exc) from None
    return ExperimentOut.of(info)


# Sync ``def`` routes run in the threadpool: the service reads the database.
@router.get("", response_model=list[ExperimentOut])
def list_experiments(service: ServiceDep, limit: Limit = PAGE, offset: Offset = 0
                     ) -> list[ExperimentOut]:
    """One page of experiments, newest first."""
    return [ExperimentOut.of(e) for e in service.experiments(limit=limit, offset=offset)]


@router.get("/{experiment_id}", response_model=ExperimentOut, responses=_MISSING)
async def show(experiment_id: IdPath, service: ServiceDep) -> ExperimentOut:
    """One experiment with its verdict so far."""
    return ExperimentOut.of(await get_experiment(service, experiment_id))


@router.post("/{experiment_id}/cancel", response_model=ExperimentOut,
             responses={**_AUTH, **_MISSING,
                        409: {"model": ErrorOut, "description": "It had already ended."}})
async def cancel(experiment_id: IdPath, service: ServiceDep, _auth: TokenDep) -> ExperimentOut:
    """Stop the experiment's job and mark it cancelled."""
    await get_experiment(service, experiment_id)
    if not await service.cancel_experiment(experiment_id):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"experiment {experiment_id} has already ended")
    return ExperimentOut.of(await get_experiment(service, experiment_id))


@router.get("/{experiment_id}/export", response_model=list[VerdictRow],
            responses={**_MISSING, 200: {"content": {"text/csv": {}}}})
async def export(
    experiment_id: IdPath,
    service: ServiceDep,
    format: Annotated[Literal["csv", "json"], Query()] = "json",
) -> Response:
    """The verdict per arm (arm, kind, ratio, low, high, p_value, reason), as CSV or JSON."""
    info = await get_experiment(service, experiment_id)
    rows = verdict_rows(info)
    filename = f"experiment-{info.id}.{format}"
    headers = {"Content-Disposition": f'attachment; filename="{filename}"'}
    if format == "json":
        return JSONResponse([VerdictRow(**r).model_dump() for r in rows], headers=headers)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=VERDICT_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if r[k] is None else r[k] for k in VERDICT_FIELDS} for r in rows)
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8", headers=headers)
