"""JSON API: runs, the live snapshot, and the readiness probe."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from traind.web.deps import ServiceDep
from traind.web.schemas import RunOut

router = APIRouter()


# Sync ``def`` routes run in the threadpool: ``runs()`` and ``health()`` may touch the database.
@router.get("/api/runs", response_model=list[RunOut])
def list_runs(service: ServiceDep) -> list[RunOut]:
    return [RunOut.of(r) for r in service.runs()]


@router.get("/api/live")
async def live_snapshot(service: ServiceDep) -> dict[str, Any]:
    # On the event loop on purpose: the hub's ring buffers are mutated by the loop, so reading
    # them from a threadpool worker could race; the snapshot is in memory and cheap.
    return service.live_snapshot()


@router.get("/healthz")
def healthz(service: ServiceDep) -> JSONResponse:
    health = service.health()
    return JSONResponse(health, status_code=200 if health.get("ok") else 503)
