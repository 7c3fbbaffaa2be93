"""A real PostgreSQL server for the queue's contract tests and the cluster test: one per
session, in a temp dir. tests/conftest.py re-exports the fixtures, so every folder has them.

Needs the server binaries (Debian: ``apt-get install postgresql``, which puts them under
/usr/lib/postgresql/<version>/bin) and psycopg (``pip install 'traind[postgres]'``). As root the
server runs as the ``postgres`` user, because ``initdb`` and ``postgres`` refuse to run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import IN_CI, free_port, require_real_part

if TYPE_CHECKING:
    from collections.abc import Iterator

HOW = "apt-get install postgresql (server binaries), or run `make test` as root"


def _pg_bin(name: str) -> str:
    """On PATH, else Debian's versioned directory (not on PATH by default), newest first."""
    found = shutil.which(name)
    if not found:
        versioned = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                           key=lambda p: int(Path(p).parts[-3]), reverse=True)
        found = versioned[0] if versioned else name
    return require_real_part(found, HOW)


def _as_server_user() -> tuple[list[str], int | None]:
    """The command prefix and uid to run the server with: ourselves, or ``postgres`` as root."""
    if os.geteuid() != 0:
        return [], None
    try:
        uid = pwd.getpwnam("postgres").pw_uid
    except KeyError:
        msg = "running as root and there is no `postgres` user to run the server as"
        if IN_CI:
            pytest.fail(f"CI=true and {msg} ({HOW})")
        pytest.skip(f"{msg} ({HOW})")
    return [require_real_part("runuser", "util-linux"), "-u", "postgres", "--"], uid


@dataclass(frozen=True)
class PostgresServer:
    port: int
    socket_dir: Path  # its Unix socket lives here: reachable from any network namespace

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/traind"

    @property
    def socket_url(self) -> str:
        """The same database through the socket file, for processes in other network
        namespaces (a filesystem socket is not bound to one, unlike 127.0.0.1)."""
        return f"postgresql+psycopg://postgres@/traind?host={self.socket_dir}&port={self.port}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway server that listens on 127.0.0.1 and a socket in its own temp dir only,
    with an empty database ``traind``; stopped at the end."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    try:
        import psycopg
    except ImportError:
        msg = "psycopg is not installed (pip install 'traind[postgres]')"
        if IN_CI:
            pytest.fail(f"CI=true and {msg}")
        pytest.skip(msg)
    prefix, uid = _as_server_user()
    # Not under pytest's tmp dir: that is mode 0700 and owned by us, so `postgres` could not
    # reach it. A short path also keeps the socket name under the 107-byte limit.
    tmp = Path(tempfile.mkdtemp(prefix="traind-pg-"))
    if uid is not None:
        os.chown(tmp, uid, -1)
    data, log, port = tmp / "data", tmp / "server.log", free_port()

    def run(*cmd: str) -> None:
        res = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            server_log = log.read_text() if log.exists() else ""
            raise AssertionError(f"{cmd[0]} failed:\n{res.stdout}{res.stderr}\n{server_log}")

    run(initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
        "--no-sync")
    # fsync off: a test server that loses data on a crash is fine, and it is much faster.
    run(pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", "60", "start", "-o",
        f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off")
    try:
        with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute("CREATE DATABASE traind")
        yield PostgresServer(port=port, socket_dir=tmp)
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """``postgresql+psycopg://postgres@127.0.0.1:PORT/traind`` on the session's server."""
    return postgres_server.url


@pytest.fixture
def fresh_postgres_url(postgres_url: str) -> str:
    """The session's database with an empty ``public`` schema (migrate it yourself)."""
    import psycopg

    with psycopg.connect(postgres_url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return postgres_url
