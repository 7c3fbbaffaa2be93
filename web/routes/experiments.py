"""JSON API for A/B experiments: submit, list, show, cancel, export the verdict.

Every POST needs the daemon's token (``Authorization: Bearer <token>``, see deps.TokenDep);
reads stay open like the rest of the API. ``traind experiments`` is a client of these routes.
"""

from __future__ import annotations

import csv
import io
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import JSONResponse, Response

from traind.daemon.service import PAGE
from traind.web.deps import IdPath, Limit, Offset, ServiceDep, TokenDep
from traind.web.errors import unprocessable
from traind.web.limits import OffLoopJSONRoute
from traind.web.lookups import AUTH, ENDED, EXPERIMENT_MISSING, get_experiment
from traind.web.schemas import ExperimentIn, ExperimentOut, VerdictRow
from traind.web.views import VERDICT_FIELDS, verdict_rows

router = APIRouter(prefix="/api/experiments", tags=["experiments"], route_class=OffLoopJSONRoute)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ExperimentOut,
             responses=AUTH)
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


@router.get("/{experiment_id}", response_model=ExperimentOut, responses=EXPERIMENT_MISSING)
async def show(experiment_id: IdPath, service: ServiceDep) -> ExperimentOut:
    """One experiment with its verdict so far."""
    return ExperimentOut.of(await get_experiment(service, experiment_id))


@router.post("/{experiment_id}/cancel", response_model=ExperimentOut,
             responses={**AUTH, **EXPERIMENT_MISSING, **ENDED})
async def cancel(experiment_id: IdPath, service: ServiceDep, _auth: TokenDep) -> ExperimentOut:
    """Stop the experiment's job and mark it cancelled."""
    await get_experiment(service, experiment_id)
    if not await service.cancel_experiment(experiment_id):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"experiment {experiment_id} has already ended")
    return ExperimentOut.of(await get_experiment(service, experiment_id))


@router.get("/{experiment_id}/export", response_model=list[VerdictRow],
            responses={**EXPERIMENT_MISSING, 200: {"content": {"text/csv": {}}}})
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
