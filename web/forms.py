"""What a browser's state-changing request must carry: a live session (see web/sessions.py),
that session's CSRF token in the form, and, when the browser sends one, an Origin that is this
very origin (scheme, host and port). The JSON API takes the daemon's token instead (deps.py).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException, status

from traind.web.hosts import from_this_origin
from traind.web.sessions import current_session

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fastapi import Request

    from traind.web.sessions import Session

LOGIN_HINT = "log in at /login with the daemon's token (var/token) first"


def check_origin(request: Request) -> None:
    """403 for a post another site's page made (the login form's guard too)."""
    if not from_this_origin(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin form post refused")


def check_form(request: Request, form: Mapping[str, Any]) -> Session:
    """The request's session, or 403: a cross-origin post, no session, or a form without the
    session's CSRF token."""
    check_origin(request)
    session = current_session(request)
    if session is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"no session: {LOGIN_HINT}")
    sent = form.get("csrf_token")
    if not isinstance(sent, str) or not secrets.compare_digest(sent, session.csrf):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "missing or wrong CSRF token")
    return session
