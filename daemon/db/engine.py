"""Engine construction: SQLite in WAL mode by default, any SQLAlchemy URL otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event

from traind.extras import require

if TYPE_CHECKING:
    from pathlib import Path


def default_url(var_dir: Path) -> str:
    return f"sqlite:///{(var_dir / 'traind.db').resolve()}"


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
