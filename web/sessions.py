"""Browser sessions, as Jupyter has them: the daemon's token is presented once, and the browser
then holds a session cookie (HttpOnly, SameSite=Strict) instead of the token.

A page read may stay open (``daemon.open_pages``), but everything that changes state from a
browser (a form, a cancel, a reorder) and the live websocket need a session: its CSRF token
and its live token are random per session and appear only in pages rendered for it, so an
anonymous client that scrapes every page finds nothing that acts.

Sessions live in memory, bounded: a daemon restart logs everyone out, which for a node-local
dashboard is the right failure. One-time login codes let ``traind serve`` hand out a link
(written to a 0600 file beside the token, never to stdout or the journal).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.requests import HTTPConnection

COOKIE = "traind_session"
SESSION_SECONDS = 24 * 3600
MAX_SESSIONS = 1024  # beyond this the oldest is dropped: logging in cannot grow memory
MAX_CODES = 16


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    csrf: str  # the forms' token, bound to this session
    live: str  # the live websocket's credential, bound to this session
    expires: float


class Sessions:
    """The daemon's browser sessions and unused one-time login codes (thread-safe)."""

    def __init__(self, *, seconds: float = SESSION_SECONDS, limit: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.limit, self._clock = seconds, limit, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._codes: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def create(self) -> Session:
        s = Session(id=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32),
                    live=secrets.token_urlsafe(32), expires=self._clock() + self.seconds)
        with self._lock:
            _add_bounded(self._sessions, s.id, s, self.limit)
        return s

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None and s.expires <= self._clock():
                del self._sessions[session_id]
                return None
        return s

    def end(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def login_code(self) -> str:
        """A code that opens one session, once (``/login?token=<code>``)."""
        code = secrets.token_urlsafe(32)
        with self._lock:
            _add_bounded(self._codes, code, None, MAX_CODES)
        return code

    def redeem(self, code: str | None) -> Session | None:
        """A new session for an unused code (which is then spent), else None."""
        if not code:
            return None
        with self._lock:
            found = next((c for c in self._codes if secrets.compare_digest(c, code)), None)
            if found is None:
                return None
            del self._codes[found]
        return self.create()


def _add_bounded(items: OrderedDict[str, Any], key: str, value: Any, limit: int) -> None:
    items[key] = value
    while len(items) > limit:  # the oldest goes first
        items.popitem(last=False)


def current_session(conn: HTTPConnection) -> Session | None:
    """The session the request's cookie names, if it is live."""
    sessions: Sessions = conn.app.state.sessions
    return sessions.get(conn.cookies.get(COOKIE))
