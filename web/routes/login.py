"""Log in and out: the daemon's token (or a one-time code from ``var/login-url``) is traded
once for a session cookie; see web/sessions.py for what a session allows.

The cookie is HttpOnly (no script reads it) and SameSite=Strict (no other site's page makes
the browser send it), and Secure when the daemon is reached over https.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from traind.web.deps import ServiceDep, TemplatesDep
from traind.web.forms import check_form, check_origin
from traind.web.sessions import COOKIE

if TYPE_CHECKING:
    from traind.web.sessions import Session, Sessions

router = APIRouter(default_response_class=HTMLResponse)


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a path on this daemon only (never ``//host`` or a URL),
    so a login link cannot send the browser elsewhere."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target if all(c.isprintable() for c in target) else "/"


def _signed_in(request: Request, session: Session, target: str) -> Response:
    response = RedirectResponse(safe_next(target), status_code=status.HTTP_303_SEE_OTHER)
    sessions: Sessions = request.app.state.sessions
    response.set_cookie(COOKIE, session.id, max_age=int(sessions.seconds), path="/",
                        httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return response


@router.get("/login", include_in_schema=False)
async def login_page(request: Request, templates: TemplatesDep, token: str | None = None,
                     next: str | None = None) -> Response:
    if token is not None:  # a one-time link: spent here, whether or not it was valid
        session = request.app.state.sessions.redeem(token)
        if session is not None:
            return _signed_in(request, session, next or "/")
        return _form(request, templates, next, "this login link was used already or is not "
                     "this daemon's: log in with the token", status.HTTP_401_UNAUTHORIZED)
    return _form(request, templates, next, None, status.HTTP_200_OK)


@router.post("/login", include_in_schema=False)
async def login(request: Request, service: ServiceDep, templates: TemplatesDep) -> Response:
    check_origin(request)  # another site must not be able to log a browser into this daemon
    form = await request.form()
    token, target = form.get("token"), str(form.get("next") or "/")
    if not isinstance(token, str) or not service.check_token(token.strip()):
        return _form(request, templates, target, "wrong token", status.HTTP_401_UNAUTHORIZED)
    return _signed_in(request, request.app.state.sessions.create(), target)


@router.post("/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    session = check_form(request, await request.form())
    request.app.state.sessions.end(session.id)
    response = RedirectResponse("/", status_code=status.HTTP_303_SEE_OTHER)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response


def _form(request: Request, templates: TemplatesDep, target: str | None, error: str | None,
          code: int) -> HTMLResponse:
    return templates.TemplateResponse(request, "login.html", {
        "page": "login", "next": safe_next(target), "error": error}, status_code=code)
