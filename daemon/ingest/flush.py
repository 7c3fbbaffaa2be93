"""The database flush: every second, what the event loop gathered goes to the database.

Worker events, run summaries and live verdicts are gathered in memory on the event loop and
written here in batches, in a worker thread (never one write per step). A database that refuses
writes is reported once per outage; what was not written is kept by each writer and retried.
The loop's heartbeat tells the systemd watchdog the supervisor is alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

log = logging.getLogger("traind")
FLUSH_SECONDS = 1.0
# The systemd watchdog is fed only while the flush loop has turned this recently.
SUPERVISOR_STALE_SECONDS = 30.0


class Flusher:
    def __init__(self, writers: Sequence[Callable[[], None]],
                 pending: Callable[[], int]) -> None:
        """``writers``: each writes what it holds (blocking) and keeps what failed;
        ``pending``: how many events wait (for the log line of an outage)."""
        self._writers = list(writers)
        self._pending = pending
        self._heartbeat = time.monotonic()

    def add(self, writer: Callable[[], None]) -> None:
        self._writers.append(writer)

    def flush(self) -> None:
        """Blocking: run it in a thread. Raises what the first refused write raised."""
        for write in self._writers:
            write()

    def alive(self) -> bool:
        """For the systemd watchdog: the flush loop (which also proves a worker thread and the
        database answer) turned lately. The event loop is proven by the ping itself."""
        return time.monotonic() - self._heartbeat < SUPERVISOR_STALE_SECONDS

    async def forever(self) -> None:
        refused_since: float | None = None  # the outage being reported, once
        while True:
            self._heartbeat = time.monotonic()  # a flush that hangs leaves it stale
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                await asyncio.to_thread(self.flush)
            except Exception as exc:
                if refused_since is None:
                    refused_since = time.monotonic()
                    log.error("the database refuses writes (%s); %d run events are held "
                              "and retried every %.0f s", str(exc).splitlines()[0][:200],
                              self._pending(), FLUSH_SECONDS)
            else:
                if refused_since is not None:
                    log.warning("the database accepts writes again after %.0f s; the held "
                                "events are stored", time.monotonic() - refused_since)
                    refused_since = None
