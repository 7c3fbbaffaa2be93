"""Security headers on every response (web/headers.py), and pages that need no inline script."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

from fastapi.testclient import TestClient

from tests.web.conftest import log_in
from tests.web.test_security import _concrete, http_routes
from traind.web.app import create_app as _create_app
from traind.web.headers import CSP

create_app = partial(_create_app, allowed_hosts=["testserver"])
TEMPLATES = __import__("pathlib").Path(__file__).parents[2] / "web" / "templates"


def test_every_response_carries_the_headers(service: Any) -> None:
    app = create_app(service)
    with TestClient(app) as c:
        log_in(c)
        paths = [_concrete(p) for m, p in http_routes(app) if m == "GET"]
        for path in [*paths, "/no-such-page", "/static/style.css"]:
            r = c.get(path, follow_redirects=False)
            h = r.headers
            assert h["x-frame-options"] == "DENY", path
            assert h["x-content-type-options"] == "nosniff", path
            assert h["referrer-policy"] == "same-origin", path
            csp = h["content-security-policy"]
            assert "frame-ancestors 'none'" in csp, path
            if path not in ("/api/docs", "/api/redoc"):
                assert csp == CSP, path


def test_the_pages_csp_runs_only_the_daemons_own_scripts() -> None:
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["script-src"] == "'self'"  # no inline script, no eval
    assert directives["object-src"] == "'none'" and directives["base-uri"] == "'none'"


def test_no_template_has_inline_script_or_handlers() -> None:
    for path in TEMPLATES.glob("*.html"):
        text = path.read_text()
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag or 'type="application/json"' in tag, (path.name, tag)
        assert not re.search(r"\son[a-z]+=", text), path.name
        assert "javascript:" not in text, path.name
