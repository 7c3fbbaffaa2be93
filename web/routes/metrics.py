"""Prometheus scrape endpoint: the daemon's registry, rendered by the service."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from traind.web.deps import ServiceDep

router = APIRouter()


# A sync route: collectors read /proc, NVML and the like, which must not stall the event loop.
@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, service: ServiceDep) -> Response:
    # The Accept header picks the format (text vs. OpenMetrics); the service knows which.
    body, content_type = service.metrics_exposition(request.headers.get("accept"))
    # Passed verbatim: Starlette would otherwise append its own charset to a text/* type.
    return Response(content=body, headers={"Content-Type": content_type})
