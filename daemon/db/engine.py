"""Engine construction: SQLite in WAL mode by default, any SQLAlchemy URL otherwise; and what
the rest of the daemon may know of an engine without importing SQLAlchemy (a URL fit to print,
the errors that mean the database refused)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, exc, make_url

from traind.extras import require

if TYPE_CHECKING:
    from pathlib import Path


# The database refused (read-only, locked, unreachable), rather than the request being wrong:
# the web layer answers these with a 503 and the daemon stays up.
REFUSED: tuple[type[Exception], ...] = (exc.OperationalError, exc.InternalError)


def default_url(var_dir: Path) -> str:
    return f"sqlite:///{(var_dir / 'traind.db').resolve()}"


def redact(url: str) -> str:
    """``url`` fit to print: its password, if any, masked."""
    return make_url(url).render_as_string(hide_password=True)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if url.startswith("postgresql+psycopg"):
        require("psycopg")  # the driver is an extra: say so in one line, before SQLAlchemy's trace
    return create_engine(url, pool_pre_ping=True)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets the web server read while the daemon writes; foreign keys are off by default.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
