"""The systemd notify protocol, spoken directly (no libsystemd binding).

Under ``Type=notify`` systemd hands the daemon a datagram socket in ``$NOTIFY_SOCKET`` (a path,
or an abstract name written ``@name``) and ``$WATCHDOG_USEC`` when ``WatchdogSec=`` is set. Each
message is one datagram of ``KEY=value`` lines. Outside systemd the variables are unset and every
call is a no-op, so the daemon runs the same under ``make serve``.

Sends never block the event loop and never raise: a full or vanished socket costs a message,
not the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping

log = logging.getLogger("traind")

# The variables systemd sets for the main process only: children (torchrun, the ranks) must
# not inherit them, or they could speak for the service (what sd_notify's unset_environment does).
ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(value: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` as a ``sendto`` address: a path, or ``@name`` for Linux's abstract
    namespace (a leading NUL byte). Other forms (``vsock:``) are not supported: None."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    return None


def watchdog_seconds(env: Mapping[str, str], pid: int) -> float | None:
    """The watchdog timeout systemd set for this process, or None when there is none.

    ``WATCHDOG_PID``, when set, names the process the timeout is meant for; another process
    (a child that inherited the environment) must not ping.
    """
    raw = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not raw.isdigit() or int(raw) == 0 or (owner and owner != str(pid)):
        return None
    return int(raw) / 1e6


class Notifier:
    """Sends notify messages to one address; ``Notifier(None)`` sends nothing."""

    def __init__(self, address: str | bytes | None, *, watchdog: float | None = None) -> None:
        self.address = address
        self.watchdog = watchdog  # seconds; ping every half of it
        self.dropped = 0  # messages that could not be sent
        self._sock: socket.socket | None = None
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> Notifier:
        """From systemd's variables, which are then removed from ``env`` (``os.environ``)."""
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        address = socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or an @abstract name; "
                        "systemd will not hear from traind", raw)
        watchdog = watchdog_seconds(env, os.getpid()) if address is not None else None
        for key in ENV_KEYS:
            env.pop(key, None)
        return cls(address, watchdog=watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields as one message; False when it could not be sent."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:  # full queue (EAGAIN), systemd gone (ENOENT, ECONNREFUSED)
            self.dropped += 1
            if self.dropped == 1:
                log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> bool:
        """Push the current start/stop timeout to at least ``seconds`` from now."""
        return self.send(f"EXTEND_TIMEOUT_USEC={round(seconds * 1e6)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def run(self, *, started: Callable[[], bool], alive: Callable[[], bool],
                  status: str = "serving", poll: float = 0.05) -> None:
        """READY=1 once ``started()``, then WATCHDOG=1 every half interval while ``alive()``.

        Run as a task on the daemon's event loop: a blocked loop sends no pings, and so does a
        supervisor that ``alive()`` finds stale; systemd then kills and restarts the service.
        """
        if not self.enabled:
            return
        while not started():
            await asyncio.sleep(poll)
        self.ready(status)
        if self.watchdog is None:
            return
        period = self.watchdog / 2
        quiet = False
        while True:
            if alive():
                self.send("WATCHDOG=1")
                quiet = False
            elif not quiet:
                quiet = True
                log.error("job supervisor stalled: withholding the systemd watchdog ping")
            await asyncio.sleep(period)

    @contextlib.asynccontextmanager
    async def extending(self, *, limit: float, step: float = 10.0) -> AsyncIterator[None]:
        """While the body runs (a job checkpointing on stop), keep pushing systemd's stop
        timeout ``2 * step`` ahead, for at most ``limit`` seconds in all: a slow checkpoint is
        not cut short, and a stuck one is still killed."""
        if not self.enabled:
            yield
            return

        async def keep_extending() -> None:
            end = time.monotonic() + limit
            while (left := end - time.monotonic()) > 0:
                self.extend_timeout(min(2 * step, left))
                await asyncio.sleep(step)

        task = asyncio.create_task(keep_extending())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
