"""Dependencies shared by the routers: the node service, the template renderer, and the
daemon token that every state-changing API request carries.

Both live on ``app.state`` (set by :func:`traind.web.app.create_app`), never in module globals,
so each test builds its own app around its own fake service.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.templating import Jinja2Templates
from pydantic import AfterValidator, BeforeValidator, Field
from starlette.requests import HTTPConnection  # noqa: TC002 (FastAPI reads it at run time)

from traind.contracts.states import RUN_STATES
from traind.daemon.service import (
    CONFIG_FILTER_MAX,
    MAX_PAGE,
    RUN_SORT_KEYS,
    NodeService,
    RunQuery,
    config_match,
)
from traind.web.schemas import INT64_MAX
from traind.web.sessions import current_session


def get_service(conn: HTTPConnection) -> NodeService:
    # HTTPConnection, not Request: the websocket route depends on this too.
    service: NodeService = conn.app.state.service
    return service


def require_reader(request: Request) -> None:
    """Pages are open to read unless the daemon says otherwise (``daemon.open_pages``); then
    a browser without a session is sent to log in first."""
    if request.app.state.open_pages or current_session(request) is not None:
        return
    raise HTTPException(status.HTTP_303_SEE_OTHER, detail="log in first",
                        headers={"Location": f"/login?next={quote(request.url.path)}"})


def get_templates(request: Request) -> Jinja2Templates:
    templates: Jinja2Templates = request.app.state.templates
    return templates


ServiceDep = Annotated[NodeService, Depends(get_service)]
IdPath = Annotated[int, Path(ge=1, le=INT64_MAX, description="An id (1 to 2^63-1).")]
# A page of a list: nothing the daemon answers grows with the data.
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"Items per page (1 to {MAX_PAGE}).")]
Offset = Annotated[int, Query(ge=0, le=INT64_MAX, description="Items to skip (the page's start).")]
# A run chosen by a query parameter (left out: the newest); bounded as every id is.
RunParam = Annotated[int | None, Query(ge=1, le=INT64_MAX, description=(
    "A run's id (1 to 2^63-1); left out: the newest run's."))]
TemplatesDep = Annotated[Jinja2Templates, Depends(get_templates)]

# auto_error=False: a missing header gets the same 401 (naming the header) as a wrong token,
# not HTTPBearer's own 403. As a security scheme it also shows in the OpenAPI document.
_bearer = HTTPBearer(auto_error=False, description="The daemon's token (var/token).")

TOKEN_HELP = "send the daemon's token as 'Authorization: Bearer <token>'"


def token_refusal(service: NodeService, token: str | None) -> str | None:
    """Why ``token`` does not open the API (the 401's detail), or None when it does."""
    if service.check_token(token):
        return None
    return f"token {'missing' if token is None else 'rejected'}: {TOKEN_HELP}"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def require_token(
    service: ServiceDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless the request carries the daemon's token (every state-changing API call).

    web/limits.py checks the same before the body is read; this one documents the scheme in
    the OpenAPI schema and guards a route that middleware does not see (none today)."""
    refusal = token_refusal(service, credentials.credentials if credentials else None)
    if refusal is not None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=refusal,
                            headers={"WWW-Authenticate": "Bearer"})


TokenDep = Annotated[None, Depends(require_token)]


# The query parameters' allowed values, from their one home (OpenAPI lists them).
RunState = Literal[RUN_STATES]  # type: ignore[valid-type]
RunSort = Literal[RUN_SORT_KEYS]  # type: ignore[valid-type]


def _blank(value: object) -> object:
    """An empty form field is no filter: a GET form sends ``state=`` for "any"."""
    return None if value == "" else value


Blank = BeforeValidator(_blank)


def _config_filter(text: str | None) -> str | None:
    if text is not None and text.strip():
        config_match(text)  # its ValueError becomes this parameter's 422
        return text.strip()
    return None


def run_query(
    state: Annotated[RunState | None, Blank, Query(description="Only runs in this state.")
                     ] = None,
    name: Annotated[str | None, Query(
        max_length=64, description="Only runs whose name holds this (any case).")] = None,
    experiment: Annotated[Annotated[int, Field(ge=1, le=INT64_MAX)] | None, Blank, Query(
        description="Only the runs of this experiment: its interleaved job, or its forked "
                    "trials' runs.")] = None,
    config: Annotated[Annotated[str, Field(max_length=CONFIG_FILTER_MAX)] | None, Blank,
                      AfterValidator(_config_filter), Query(examples=["precision.mode=bf16"],
        description="Only runs whose config holds this value at this dotted key: "
                    "``key=value``; the value matches as a string, and as a number, true, "
                    "false or null where it reads as one.")] = None,
    sort: Annotated[RunSort, Query(description="The column to sort by.")] = "id",
    order: Annotated[Literal["asc", "desc"], Query(description="Sort order.")] = "desc",
) -> RunQuery:
    """The runs table's filters and order, for the API and the page alike."""
    return RunQuery(state=state, name=(name or "").strip() or None, sort=sort,
                    descending=order == "desc", experiment=experiment,
                    config=config_match(config) if config else None)


RunQueryDep = Annotated[RunQuery, Depends(run_query)]
