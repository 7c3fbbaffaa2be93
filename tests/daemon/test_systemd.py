"""The systemd unit as systemd judges it, and `traind serve` speaking the notify protocol to a
real datagram socket the way systemd's manager would receive it."""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil
import pytest

from tests.conftest import require_real_part, start_daemon, stop_daemon
from traind.cli.service import default_traind, render_unit, template

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

HOW = "apt-get install systemd (ships systemd-analyze)"
MAX_EXPOSURE = 3.0


@pytest.fixture
def unit(tmp_path: Path) -> Path:
    """The unit as `traind service install` writes it, ExecStart = this venv's traind (verify
    checks that the binary exists)."""
    path = tmp_path / "traind.service"
    path.write_text(render_unit(template(), traind=default_traind(),
                                config=tmp_path / "traind.toml", user="traind", group="traind"))
    return path


def settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_unit_passes_systemd_analyze_verify(unit: Path):
    analyze = require_real_part("systemd-analyze", HOW)
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                       timeout=60, cwd=unit.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "traind.service" not in r.stderr, r.stderr  # no warning about our unit either


def test_unit_security_exposure_is_at_most_3(unit: Path):
    analyze = require_real_part("systemd-analyze", HOW)
    r = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(unit)],
                       capture_output=True, text=True, timeout=60, cwd=unit.parent)
    m = re.search(r"Overall exposure level for traind\.service: (\d+(?:\.\d+)?)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, r.stdout


def test_unit_notifies_keeps_the_gpus_and_stops_through_the_daemon(unit: Path):
    s = settings(unit)
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["ExecStart"] == [f"{default_traind()} serve --config {unit.parent}/traind.toml"]
    # PrivateDevices=yes would hide /dev/nvidia*; a closed policy lets only them through.
    assert s["PrivateDevices"] == ["no"] and s["DevicePolicy"] == ["closed"]
    assert "char-nvidia* rw" in s["DeviceAllow"]
    assert s["MemoryDenyWriteExecute"] == ["no"]  # the JITs need W+X memory
    assert s["KillMode"] == ["mixed"]  # SIGTERM to the daemon only: it checkpoints the job
    assert s["ProtectSystem"] == ["strict"] and s["StateDirectory"] == ["traind"]
    assert s["CapabilityBoundingSet"] == [""] and s["NoNewPrivileges"] == ["yes"]


@dataclass
class NotifySocket:
    """A datagram socket bound where NOTIFY_SOCKET points; a thread records what arrives."""

    path: Path
    messages: list[tuple[float, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def times(self, field_: str) -> list[float]:
        return [t for t, m in list(self.messages) if field_ in m.split("\n")]

    def wait_for(self, field_: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := self.times(field_):
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no {field_} within {timeout} s: {self.messages}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    path = tmp_path / "notify.sock"
    assert len(str(path)) < 100, "Unix socket paths are limited to ~107 bytes"
    s = NotifySocket(path)
    yield s
    s.close()


@pytest.mark.slow
def test_serve_notifies_ready_watchdog_and_stopping(
        tmp_path: Path, notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_socket.path))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # WatchdogSec=1: a ping every ~0.5 s
    daemon = start_daemon(tmp_path, steps=1_000_000)  # returns once /healthz answers
    try:
        serving = time.monotonic()
        ready = notify_socket.wait_for("READY=1", timeout=5)
        assert ready <= serving + 5
        first = next(m for _, m in notify_socket.messages if "READY=1" in m)
        assert f"MAINPID={daemon.proc.pid}" in first.split("\n")

        time.sleep(3.2)
        pings = [t for t in notify_socket.times("WATCHDOG=1") if t > ready]
        gaps = [b - a for a, b in itertools.pairwise([ready, *pings])]
        assert len(pings) >= 5, notify_socket.messages
        assert max(gaps) < 1.0, f"a watchdog deadline (1 s) was missed: {gaps}"

        # The ranks (and torchrun) must not inherit the notify socket.
        deadline = time.monotonic() + 60
        while not (workers := psutil.Process(daemon.proc.pid).children(recursive=True)):
            assert time.monotonic() < deadline, "no worker started"
            time.sleep(0.2)
        for w in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                assert "NOTIFY_SOCKET" not in w.environ(), w.cmdline()

        sent = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        assert notify_socket.wait_for("STOPPING=1", timeout=10) >= sent
        assert daemon.proc.wait(120) == 0
        extends = [m for _, m in notify_socket.messages if m.startswith("EXTEND_TIMEOUT_USEC=")]
        assert extends, f"no EXTEND_TIMEOUT_USEC while the job stopped: {notify_socket.messages}"
    finally:
        stop_daemon(daemon)
