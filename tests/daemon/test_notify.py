"""daemon/notify.py against a real datagram socket: the messages systemd would read."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

import pytest

from traind.daemon.notify import Notifier, socket_address, watchdog_seconds

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A bound datagram socket standing in for systemd's notify socket."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield path, sock
    sock.close()


def drain(sock: socket.socket) -> list[str]:
    got = []
    sock.setblocking(False)
    try:
        while True:
            got.append(sock.recv(4096).decode())
    except BlockingIOError:
        return got
    finally:
        sock.settimeout(2)


@pytest.mark.parametrize(("value", "expected"), [
    ("/run/systemd/notify", "/run/systemd/notify"),
    ("@traind/notify", b"\0traind/notify"),
    ("@", None),
    ("vsock:2:1234", None),
    ("relative/path", None),
])
def test_socket_address(value: str, expected: str | bytes | None):
    assert socket_address(value) == expected


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "42"}, 1.0),
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "43"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_seconds(env: dict[str, str], expected: float | None):
    assert watchdog_seconds(env, pid=42) == expected


def test_unset_is_a_silent_no_op():
    n = Notifier.from_env({})
    assert not n.enabled and n.watchdog is None
    assert n.ready("x") is False and n.send("WATCHDOG=1") is False


def test_from_env_takes_the_variables_away_from_children(listener):
    path, _ = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "PATH": "/bin"}
    n = Notifier.from_env(env)
    assert n.enabled and n.watchdog == 2.0
    assert env == {"PATH": "/bin"}
    n.close()


def test_messages_reach_a_path_socket(listener):
    path, sock = listener
    n = Notifier(path)
    assert n.ready("serving on 127.0.0.1:8800")
    fields = sock.recv(4096).decode().split("\n")
    assert fields[0] == "READY=1" and "STATUS=serving on 127.0.0.1:8800" in fields
    assert n.extend_timeout(20)
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=20000000"
    n.close()


def test_messages_reach_an_abstract_socket():
    name = f"@traind-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name[1:].encode())
        sock.settimeout(2)
        n = Notifier.from_env({"NOTIFY_SOCKET": name})
        assert n.stopping("bye")
        assert sock.recv(4096) == b"STOPPING=1\nSTATUS=bye"
        n.close()


def test_a_vanished_socket_costs_a_message_not_the_daemon(tmp_path: Path):
    n = Notifier(str(tmp_path / "gone.sock"))
    assert n.send("WATCHDOG=1") is False and n.dropped == 1
    n.close()


async def _run_for(n: Notifier, seconds: float, **kw) -> None:
    task = asyncio.create_task(n.run(**kw))
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_ready_waits_for_the_server_then_pings_at_half_the_interval(listener):
    path, sock = listener
    n = Notifier(path, watchdog=0.2)
    started_at = time.monotonic() + 0.3

    asyncio.run(_run_for(n, 1.0, started=lambda: time.monotonic() >= started_at,
                         alive=lambda: True))
    msgs = drain(sock)
    assert msgs[0].startswith("READY=1")
    pings = msgs[1:]
    assert set(pings) == {"WATCHDOG=1"}
    assert 5 <= len(pings) <= 9  # 0.7 s of pings every 0.1 s
    n.close()


def test_a_stalled_supervisor_gets_no_pings(listener):
    path, sock = listener
    n = Notifier(path, watchdog=0.2)
    asyncio.run(_run_for(n, 0.5, started=lambda: True, alive=lambda: False))
    assert [m.split("\n")[0] for m in drain(sock)] == ["READY=1"]
    n.close()


def test_a_blocked_event_loop_sends_no_pings(listener):
    path, sock = listener
    n = Notifier(path, watchdog=0.2)
    arrivals: list[float] = []

    async def main() -> None:
        task = asyncio.create_task(n.run(started=lambda: True, alive=lambda: True))
        await asyncio.sleep(0.35)
        time.sleep(0.6)  # a blocking call on the loop
        await asyncio.sleep(0.35)
        task.cancel()

    collector = threading.Thread(target=_collect, args=(sock, arrivals, 1.2))
    collector.start()
    asyncio.run(main())
    collector.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) >= 0.5, gaps  # systemd would have seen the missed deadline
    n.close()


def _collect(sock: socket.socket, arrivals: list[float], seconds: float) -> None:
    end = time.monotonic() + seconds
    sock.settimeout(0.05)
    while time.monotonic() < end:
        try:
            if sock.recv(4096) == b"WATCHDOG=1":
                arrivals.append(time.monotonic())
        except TimeoutError:
            pass


def test_extending_pushes_the_stop_timeout_while_the_body_runs(listener):
    path, sock = listener
    n = Notifier(path)

    async def main() -> None:
        async with n.extending(limit=10, step=0.1):
            await asyncio.sleep(0.35)

    asyncio.run(main())
    msgs = drain(sock)
    assert 3 <= len(msgs) <= 5
    assert set(msgs) == {"EXTEND_TIMEOUT_USEC=200000"}
    n.close()


def test_extending_stops_at_its_limit(listener):
    path, sock = listener
    n = Notifier(path)

    async def main() -> None:
        async with n.extending(limit=0.25, step=0.1):
            await asyncio.sleep(0.6)

    asyncio.run(main())
    msgs = drain(sock)
    assert len(msgs) == 3  # at 0, 0.1, 0.2 s; the last one only up to the limit
    assert msgs[-1] != "EXTEND_TIMEOUT_USEC=200000"
