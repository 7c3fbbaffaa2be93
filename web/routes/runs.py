"""JSON API for one run: its record, its stored series (downsampled for a chart, or every step
as CSV) and a stop. The run page (web/routes/run_pages.py) draws from these routes.

A stop needs the daemon's token like every state-changing call; the reads stay open.
"""

from __future__ import annotations

import csv
import io
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, status
from fastapi.responses import FileResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from traind.web.deps import IdPath, ServiceDep, TokenDep
from traind.web.encode import json_pieces
from traind.web.heavy import HeavyDep
from traind.web.limits import OffLoopJSONRoute
from traind.web.lookups import (
    AUTH,
    CAPTURE_MISSING,
    ENDED,
    RUN_MISSING,
    ask_profile,
    get_profile,
    get_run_detail,
)
from traind.web.schemas import INT64_MAX, CaptureOut, ProfileIn, RunOut

router = APIRouter(prefix="/api/runs", tags=["runs"], route_class=OffLoopJSONRoute)

# A chart wants a few thousand points; more would only slow the page (and the daemon).
Points = Annotated[int, Query(ge=10, le=20_000, description=(
    "Points per line at most: each stands for a bucket of steps, drawn at its mean with "
    "the bucket's min and max."))]

Ranks = Annotated[bool, Query(description=(
    "Also a line per rank of what differs between ranks (multi-rank runs)."))]

Comm = Annotated[bool, Query(description=(
    "Also the run's communication per op over steps (multi-rank runs)."))]

After = Annotated[int | None, Query(ge=-1, le=INT64_MAX - 1, description=(
    "Only what came since this step, for a page that polls: the steps after it and the "
    "reports (evaluations, switches, layers, ranks, comm) from it on, at full resolution, "
    "the first `points` of them (`more` says some were left out)."))]


@router.get("/{run_id}", response_model=RunOut, responses=RUN_MISSING)
async def get_run(run_id: IdPath, service: ServiceDep) -> RunOut:
    return RunOut.of((await get_run_detail(service, run_id)).run)


BUSY: dict[int | str, dict[str, Any]] = {429: {"description": (
    "This client already has its share of whole-run reads running or waiting "
    "(web/heavy.py); retry after a second.")}}


@router.get("/{run_id}/series", responses={**RUN_MISSING, **BUSY,
                                           200: {"content": {"application/json": {}}}})
async def series(run_id: IdPath, service: ServiceDep, heavy: HeavyDep, request: Request,
                 points: Points = 2000, ranks: Ranks = False, comm: Comm = False,
                 after: After = None) -> Response:
    """The run's stored steps (loss, lr, grad norm, tokens/s, step and data seconds), each
    figure ``{"y", "lo", "hi"}`` per point; its evaluations, per-layer norms (layer x step)
    and precision switches. The same after the run ended and after a daemon restart. Each
    point stands for a bucket of steps of equal width (from the run's first stored step to
    its newest), drawn at the bucket's newest step.

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
    ``table``), and ``"more"`` is true when steps were left out.

    A whole series (no ``after``) reads every stored chunk of the run: such reads take
    turns on the node, and a client with 4 of them running or waiting gets 429."""
    def read() -> dict[str, Any] | None:
        return service.run_series(run_id, points=points, ranks=ranks, comm=comm, after=after)

    # A tail reads the newest few chunks; a whole series every one, in turn.
    page = await (run_in_threadpool(read) if after is not None
                  else heavy.run(_client(request), read))
    if page is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    # Written as it is sent, a piece at a time, off the loop: never the whole body at once.
    return StreamingResponse(json_pieces(page), media_type="application/json")


@router.get("/{run_id}/series.csv", responses={**RUN_MISSING, **BUSY,
                                                200: {"content": {"text/csv": {}}}})
async def export(run_id: IdPath, service: ServiceDep, heavy: HeavyDep,
                 request: Request) -> Response:
    """Every stored step at full resolution, with the validation loss where it ran."""
    def read() -> str | None:
        rows = service.run_export(run_id)
        if rows is None:
            return None
        out = io.StringIO()
        csv.writer(out).writerows(["" if v is None else v for v in row] for row in rows)
        return out.getvalue()

    text = await heavy.run(_client(request), read)
    if text is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return Response(text, media_type="text/csv", headers={
        "Content-Disposition": f'attachment; filename="run-{run_id}.csv"'})


def _client(request: Request) -> str:
    return request.client.host if request.client is not None else ""


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


@router.post("/{run_id}/profile", status_code=status.HTTP_202_ACCEPTED,
             response_model=CaptureOut, responses={**AUTH, **RUN_MISSING, **ENDED})
async def profile(run_id: IdPath, body: ProfileIn, service: ServiceDep, _auth: TokenDep
                  ) -> CaptureOut:
    """Profile the running run: from its next report step, each chosen rank traces ``steps``
    steps with torch.profiler (CPU and, on GPUs, CUDA activity; memory and shapes), and the
    daemon builds a report of where the time went: compute, communication and idle per rank,
    their overlap, the top operators, memory over the steps and the ranks' arrival at each
    step's first collective (202: asked; poll the capture, or open ``report_url``). 409
    while a capture is under way or when the run is not running here; 422 for a rank the
    job lacks."""
    return CaptureOut.of(await ask_profile(service, run_id, steps=body.steps,
                                           ranks=body.ranks))


@router.get("/{run_id}/profiles", response_model=list[CaptureOut], responses=RUN_MISSING)
async def profiles(run_id: IdPath, service: ServiceDep) -> list[CaptureOut]:
    """The run's profile captures, newest first."""
    found = await run_in_threadpool(service.profiles, run_id)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id}")
    return [CaptureOut.of(c) for c in found]


@router.get("/{run_id}/profiles/{capture}", responses=CAPTURE_MISSING)
async def profile_report(run_id: IdPath, capture: IdPath, service: ServiceDep
                         ) -> dict[str, Any]:
    """A capture (``capture``, as in the list) and its report (``report``: null until the
    state is ``ready``): per rank the window, compute, communication (all of it, and the
    part no compute overlaps), memory copies and idle in ms, their overlap share, the same
    per step, the top operators by self time and allocated memory over the steps; per step
    each rank's arrival at its first collective (ms after the first rank, on the ranks'
    shared clock) and the last rank."""
    found, body = await get_profile(service, run_id, capture)
    return {"capture": CaptureOut.of(found).model_dump(), "report": body}


@router.get("/{run_id}/profiles/{capture}/traces/{rank}", responses={
    **CAPTURE_MISSING, 200: {"content": {"application/gzip": {}}}})
async def profile_trace(run_id: IdPath, capture: IdPath,
                        rank: Annotated[int, Path(ge=0, le=65_535)], service: ServiceDep
                        ) -> FileResponse:
    """One rank's trace, gzipped Chrome trace JSON: open it in Perfetto (ui.perfetto.dev)
    or chrome://tracing."""
    path = await run_in_threadpool(service.profile_trace, run_id, capture, rank)
    if path is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"no trace of rank {rank} in capture {capture} of run {run_id}")
    return FileResponse(path, media_type="application/gzip",
                        filename=f"run{run_id}-profile{capture}-rank{rank}.json.gz")
