"""The node's experiment slots: one pool that every runner of scheduled experiment work takes.

Interleaved experiments' jobs, forked experiments' base jobs and trials, and so the auto-tuner's
rounds (which are experiments), and this node's part of a cluster job (``experiments/cluster.py``)
each hold a slot while they train. ``daemon.max_experiment_jobs``
slots (default 1) exist per node: at once, two experiment jobs share the node's cores and
measure each other, so they run one at a time unless the user allows more. A freed slot is
handed straight to the waiter of the oldest experiment (lowest id), whatever its mode, so a
queued interleaved experiment starts when a forked trial ends and vice versa.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from typing import TYPE_CHECKING

from traind.daemon.service import ShuttingDown

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class Slots:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size: must be at least 1 (got {size})")
        self.size = size
        self._free = size
        # (experiment id, arrival, future): the lowest id first, then the earliest arrival.
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._closed = False

    @property
    def busy(self) -> int:
        """Slots held now."""
        return self.size - self._free

    def try_acquire(self) -> bool:
        """Take a slot if one is free now (never ahead of a waiter: a freed slot goes to a
        waiter directly, so a free slot means nobody waits)."""
        if self._closed:
            raise ShuttingDown("the daemon is shutting down: nothing new starts")
        if self._free == 0:
            return False
        self._free -= 1
        return True

    async def acquire(self, key: int) -> None:
        """Wait for a slot; ``key`` orders the waiters (an experiment's id: the oldest first).
        ``ShuttingDown`` once :meth:`close` was called."""
        if self.try_acquire():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (key, next(self._arrivals), fut))
        try:
            await fut
        except asyncio.CancelledError:
            # Handed a slot in the moment it was cancelled: pass it on, or it would be lost.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back: to the first live waiter, else to the pool."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # a cancelled waiter's future is done: skipped
                fut.set_result(None)
                return
        if self._free >= self.size:
            raise RuntimeError("a slot was released that was never taken")
        self._free += 1

    @contextlib.asynccontextmanager
    async def hold(self, key: int) -> AsyncIterator[None]:
        """A slot for the body of a ``with`` (see :meth:`acquire`)."""
        await self.acquire(key)
        try:
            yield
        finally:
            self.release()

    def close(self) -> None:
        """The node stops: every waiter, and every later acquire, raises ``ShuttingDown``
        (their work stays queued for the next start)."""
        self._closed = True
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_exception(ShuttingDown("the daemon is shutting down: nothing new "
                                               "starts"))
