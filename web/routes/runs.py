"""JSON API for one run: its record, its stored series (downsampled for a chart, or every step
as CSV) and a stop. The run page (web/routes/run_pages.py) draws from these routes.

A stop needs the daemon's token like every state-changing call; the reads stay open.
"""

from __future__ import annotations

import csv
import io
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from traind.web.deps import IdPath, ServiceDep, TokenDep
from traind.web.lookups import AUTH, ENDED, RUN_MISSING, get_run_detail
from traind.web.schemas import RunOut

router = APIRouter(prefix="/api/runs", tags=["runs"])

# A chart wants a few thousand points; more would only slow the page (and the daemon).
Points = Annotated[int, Query(ge=10, le=20_000, description=(
    "Points per line at most: each stands for a bucket of steps, drawn at its mean with "
    "the bucket's min and max."))]

Ranks = Annotated[bool, Query(description=(
    "Also a line per rank of what differs between ranks (multi-rank runs)."))]

Comm = Annotated[bool, Query(description=(
    "Also the run's communication per op over steps (multi-rank runs)."))]

After = Annotated[int | None, Query(ge=-1, description=(
    "Only what came since this step, for a page that polls: the steps after it and the "
    "reports (evaluations, switches, layers, ranks, comm) from it on, at full resolution, "
    "the first `points` of them (`more` says some were left out)."))]


@router.get("/{run_id}", response_model=RunOut, responses=RUN_MISSING)
async def get_run(run_id: IdPath, service: ServiceDep) -> RunOut:
    return RunOut.of((await get_run_detail(service, run_id)).run)


@router.get("/{run_id}/series", responses=RUN_MISSING)
async def series(run_id: IdPath, service: ServiceDep, points: Points = 2000,
                 ranks: Ranks = False, comm: Comm = False, after: After = None
                 ) -> dict[str, Any]:
    """The run's stored steps (loss, lr, grad norm, tokens/s, step and data seconds), each
    figure ``{"y", "lo", "hi"}`` per point; its evaluations, per-layer norms (layer x step)
    and precision switches. The same after the run ended and after a daemon restart.

    ``ranks=true`` adds ``"ranks"``: ``"lines"``, one per rank (``rank``, ``step`` and each
    of loss, tokens/s (the rank's own), step, data, forward, backward and optimizer seconds
    per point, a bucket's mean), and ``"table"``, each rank's medians with ``slow``: the
    phases in which it is the straggler. Both empty for a run of one rank.

    ``comm=true`` adds ``"comm"``: ``"ops"``, one line per collective op (``op``, ``step``,
    ``calls`` per rank and step, ``bytes_per_second`` and ``bus_bandwidth`` (nccl-tests'
    factors), latency ``mean``, ``p50``, ``p95``, ``p99`` in seconds from the latency
    buckets, summed over ranks and sizes), and ``"bytes"`` (``step``, ``raw`` and ``sent``
    bytes per rank and step, their ``ratio``). Empty for a run of one rank.

    ``after=STEP`` answers a poll's tail: ``"after"`` is set, ``points`` counts the steps
    after STEP it holds (at most ``points``), each figure is ``{"y"}`` (one step a point),
    the reports are those from STEP on (layers one column a report, ranks without
    ``table``), and ``"more"`` is true when steps were left out."""
    found = await run_in_threadpool(
        lambda: service.run_series(run_id, points=points, ranks=ranks, comm=comm,
                                   after=after))
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return found


@router.get("/{run_id}/series.csv", responses={**RUN_MISSING,
                                                200: {"content": {"text/csv": {}}}})
async def export(run_id: IdPath, service: ServiceDep) -> Response:
    """Every stored step at full resolution, with the validation loss where it ran."""
    rows = await run_in_threadpool(service.run_export, run_id)
    if rows is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    out = io.StringIO()
    csv.writer(out).writerows(["" if v is None else v for v in row] for row in rows)
    return Response(out.getvalue(), media_type="text/csv", headers={
        "Content-Disposition": f'attachment; filename="run-{run_id}.csv"'})


@router.post("/{run_id}/stop", status_code=status.HTTP_202_ACCEPTED, response_model=RunOut,
             responses={**AUTH, **RUN_MISSING, **ENDED})
async def stop(run_id: IdPath, service: ServiceDep, _auth: TokenDep) -> RunOut:
    """Ask the run to checkpoint and exit at its next step boundary (202: asked; its state
    turns ``stopped`` once it has gone)."""
    detail = await get_run_detail(service, run_id)
    if not await service.stop_run(run_id):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"run {run_id} is not running on this node ({detail.run.state})")
    return RunOut.of(detail.run)


@router.post("/{run_id}/probe-links", status_code=status.HTTP_202_ACCEPTED,
             response_model=RunOut, responses={**AUTH, **RUN_MISSING, **ENDED})
async def probe_links(run_id: IdPath, service: ServiceDep, _auth: TokenDep) -> RunOut:
    """Ask a running multi-rank run to measure its rank-to-rank latency and bandwidth again
    at its next report step (202: asked; the matrix replaces the last one in
    ``traind_link_*`` and on /comm). The mesh keeps the placement it started with."""
    detail = await get_run_detail(service, run_id)
    if not await service.probe_links(run_id):
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"run {run_id} is not running on this node with more than one "
                            f"rank ({detail.run.state})")
    return RunOut.of(detail.run)
