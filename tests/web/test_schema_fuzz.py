"""Schemathesis over the whole OpenAPI schema, in-process against the app and the fake service:
no 5xx and every response as the schema documents it (status code, content type, body).

The token goes with every request, so bodies get past the guard to validation and the service.
Examples per operation are bounded to keep the run short (well under a minute). Requests go
through Starlette's TestClient (httpx), not schemathesis' own requests-based client: this venv
has urllib3-future standing in for urllib3, which that client does not work with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.web.conftest import (
    TOKEN,
    FakeService,
    comm_samples,
    gpu_samples,
    host_samples,
    sample_promotions,
    sample_runs,
    sample_trials,
)
from traind.web.app import create_app

if TYPE_CHECKING:
    from collections.abc import Iterator

# A node with something in every list: runs, samples, promotions, waiting trials.
SERVICE = FakeService(run_views=sample_runs(), metric_samples=[
    *host_samples(), *gpu_samples(2), *comm_samples()], promotion_views=sample_promotions(),
    trials=sample_trials())
APP = create_app(SERVICE, allowed_hosts=["testserver"])  # TestClient's Host
schema = schemathesis.openapi.from_asgi("/api/openapi.json", APP)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(APP) as c:
        yield c


def _send(client: TestClient, case: schemathesis.Case) -> Any:
    """The case as schemathesis would send it (requests-style keywords), through httpx."""
    kw = case.as_transport_kwargs(base_url="http://testserver",
                                  headers={"Authorization": f"Bearer {TOKEN}"})
    body: dict[str, Any] = {}
    if "json" in kw:
        body["json"] = kw["json"]
    elif isinstance(kw.get("data"), bytes | str):
        body["content"] = kw["data"]
    elif kw.get("data") is not None:
        body["data"] = kw["data"]
    if kw.get("files"):
        body["files"] = kw["files"]
    return client.request(kw["method"], kw["url"], headers=kw["headers"], params=kw["params"],
                          cookies=kw["cookies"] or None, follow_redirects=False, **body)


@schema.parametrize()
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_api_conforms_to_its_schema(case: schemathesis.Case, client: TestClient) -> None:
    case.validate_response(_send(client, case), checks=CHECKS)


def _pages_schema() -> dict[str, Any]:
    """The pages' own query and path parameters as an OpenAPI document: the GET pages are
    left out of the API's schema (they answer HTML), so a shadow app declares the same
    endpoints (their signatures are their parameters) with the schema on."""
    from fastapi import FastAPI
    from fastapi.routing import APIRoute, iter_route_contexts

    shadow = FastAPI(title="traind pages", openapi_url=None)
    for context in iter_route_contexts(APP.routes):
        route = context.original_route
        if (isinstance(route, APIRoute) and not route.include_in_schema
                and route.methods == {"GET"} and not route.path.startswith("/static")):
            shadow.add_api_route(route.path, route.endpoint, methods=["GET"],
                                 dependencies=route.dependencies)
    return shadow.openapi()


pages = schemathesis.openapi.from_dict(_pages_schema())


@pages.parametrize()
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_pages_answer_any_query_without_a_server_error(case: schemathesis.Case,
                                                       client: TestClient) -> None:
    """Issue 40: a page's query parameters (``/runs/compare?ids=``, ``/?run=``) went
    unfuzzed, and 20-digit ids were 500s. HTML bodies are not in any schema, so the check is
    the one that matters here: no 5xx."""
    case.validate_response(_send(client, case), checks=[not_a_server_error])
