"""The EventHub: live series in ring buffers, and pub/sub to browsers.

Each message is a plain dict (JSON-ready). The hub keeps the last ``capacity`` points per run
for the first paint of a page, and fans each new message out to subscribers through bounded
queues: a slow browser loses its oldest messages (counted in ``dropped``), never the daemon's
memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


# The message types the hub keeps for a page's first paint, and the snapshot key of each:
# adaptive precision's switches and per-window SNRs (one message per window, not per step)
# feed the run page's precision timeline.
SERIES = {"step": "steps", "eval": "evals", "precision": "precision", "snr": "snr"}


class EventHub:
    def __init__(self, *, capacity: int = 2000, subscriber_queue: int = 256) -> None:
        self._capacity = capacity
        self._subscriber_queue = subscriber_queue
        self._series: dict[str, dict[int, deque[dict[str, Any]]]] = {k: {} for k in SERIES}
        self._steps, self._evals = self._series["step"], self._series["eval"]
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.dropped = 0  # messages dropped from slow subscribers' queues

    def publish(self, message: dict[str, Any]) -> None:
        """Record a point of a kept series (:data:`SERIES`) and fan it out. Call on the event
        loop."""
        kind, run = message["type"], message["run"]
        store = self._series.get(kind)
        if store is not None:
            store.setdefault(run, deque(maxlen=self._capacity)).append(message)
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
                self.dropped += 1
            q.put_nowait(message)

    def forget(self, run_id: int) -> None:
        """Drop an ended run's buffered points (its history is in the DB): the hub holds what
        the live pages draw, not every run a long-lived daemon trained."""
        for store in self._series.values():
            store.pop(run_id, None)

    def snapshot(self, run: int | None = None) -> dict[str, Any]:
        """Run ``run``'s buffered points (none buffered: empty series), else the newest
        run's: what a page draws before live updates."""
        if run is None:
            if not self._steps and not self._evals:
                return {"type": "snapshot", "run": None, **{key: [] for key in SERIES.values()}}
            run = max([*self._steps, *self._evals])
        return {"type": "snapshot", "run": run, **{
            key: list(self._series[kind].get(run, ())) for kind, key in SERIES.items()}}

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=self._subscriber_queue)
        self._subscribers.add(q)

        async def messages() -> AsyncIterator[dict[str, Any]]:
            while True:
                yield await q.get()

        try:
            yield messages()
        finally:
            self._subscribers.discard(q)
