"""Dependencies shared by the routers: the node service and the template renderer.

Both live on ``app.state`` (set by :func:`traind.web.app.create_app`), never in module globals,
so each test builds its own app around its own fake service.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.templating import Jinja2Templates
from starlette.requests import HTTPConnection

from traind.daemon.service import NodeService


def get_service(conn: HTTPConnection) -> NodeService:
    # HTTPConnection, not Request: the websocket route depends on this too.
    service: NodeService = conn.app.state.service
    return service


def get_templates(request: Request) -> Jinja2Templates:
    templates: Jinja2Templates = request.app.state.templates
    return templates


ServiceDep = Annotated[NodeService, Depends(get_service)]
TemplatesDep = Annotated[Jinja2Templates, Depends(get_templates)]
