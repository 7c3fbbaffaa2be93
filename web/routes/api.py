"""JSON API: runs, the live snapshot, communication and hardware over time, current metric
samples, and the readiness probe."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from traind.daemon.service import PAGE
from traind.web.deps import Limit, Offset, RunParam, RunQueryDep, ServiceDep
from traind.web.schemas import CommHistoryOut, HardwareHistoryOut, RunOut, SampleOut

router = APIRouter()


# Sync ``def`` routes run in the threadpool: ``runs()`` and ``health()`` may touch the database.
@router.get("/api/runs", response_model=list[RunOut], tags=["runs"])
def list_runs(service: ServiceDep, query: RunQueryDep, limit: Limit = PAGE, offset: Offset = 0
              ) -> list[RunOut]:
    """One page of runs, newest first, or filtered and sorted as asked."""
    return [RunOut.of(r) for r in service.runs(limit=limit, offset=offset, query=query)]


@router.get("/api/live")
async def live_snapshot(service: ServiceDep, run: RunParam = None) -> dict[str, Any]:
    """The live series buffered in memory for run ``run`` (left out: the newest run's)."""
    # On the event loop on purpose: the hub's ring buffers are mutated by the loop, so reading
    # them from a threadpool worker could race; the snapshot is in memory and cheap.
    return service.live_snapshot(run)


# In memory and mutated by the event loop, like the live snapshot: read on the loop.
@router.get("/api/comm/history", response_model=CommHistoryOut, tags=["metrics"])
async def comm_history(service: ServiceDep, run: RunParam = None) -> dict[str, Any]:
    """Run ``run``'s communication over the last hour (left out: the newest run's): per-op
    collective latency percentiles per 5 s, and the all-reduce probe's bus bandwidth per
    message size (needs ``telemetry.probe_every`` > 0 in the run's config; off by default)."""
    return service.comm_history(run)


@router.get("/api/hardware/history", response_model=HardwareHistoryOut, tags=["metrics"])
async def hardware_history(service: ServiceDep) -> dict[str, Any]:
    """This node's host CPU and memory and each GPU's utilisation, power, PCIe and NVLink
    traffic over the last hour, a sample every 5 s (Prometheus keeps the long term)."""
    return service.hardware_history()


@router.get("/api/samples", response_model=list[SampleOut])
def list_samples(
    service: ServiceDep,
    # traind's own families only (the catalog's namespace, documented in docs/metrics.md):
    # whatever else ends up in the registry is no promise of this API.
    prefix: Annotated[str, Query(pattern=r"^traind_", max_length=200)],
) -> list[SampleOut]:
    # A sync route (threadpool): collecting reads NVML, /proc and psutil.
    return [SampleOut.model_validate(s) for s in service.samples(prefix)]


@router.get("/healthz")
def healthz(service: ServiceDep) -> JSONResponse:
    health = service.health()
    return JSONResponse(health, status_code=200 if health.get("ok") else 503)
