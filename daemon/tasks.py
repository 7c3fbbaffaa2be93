"""Long-lived asyncio tasks kept by key: one per forked experiment, search or slot loop.

The runners (forked experiments, the auto-tuner, cluster slots) each start a task per thing they
drive, forget it when it ends, let tests wait for it and cancel them all at node shutdown. That
bookkeeping is the same everywhere, so it lives here once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class KeyedTasks(Generic[K]):
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix  # task names read "<prefix>-<key>" in asyncio's debug output
        self._tasks: dict[K, asyncio.Task[None]] = {}

    def start(self, key: K, run: Callable[[], Coroutine[Any, Any, None]],
              on_done: Callable[[], object] | None = None) -> bool:
        """Start ``run()`` under ``key`` unless one runs already (False then). ``on_done`` runs
        when it ends, however it ends."""
        if key in self._tasks:
            return False
        task = asyncio.create_task(run(), name=f"{self._prefix}-{key}")
        self._tasks[key] = task

        def done(_t: asyncio.Task[None]) -> None:
            self._tasks.pop(key, None)
            if on_done is not None:
                on_done()

        task.add_done_callback(done)
        return True

    def keys(self) -> list[K]:
        return list(self._tasks)

    async def wait(self, key: K) -> None:
        """Until the task under ``key`` has ended (a no-op when none runs). Waiting does not
        cancel it when the waiter is cancelled."""
        if (task := self._tasks.get(key)) is not None:
            await asyncio.shield(task)

    def cancel(self, key: K) -> None:
        if (task := self._tasks.get(key)) is not None:
            task.cancel()

    async def close(self) -> None:
        """Cancel every task and wait until each has ended; none is listed afterwards (their
        done callbacks would only run on a later turn of the loop)."""
        closing = dict(self._tasks)
        for task in closing.values():
            task.cancel()
        for key, task in closing.items():
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if self._tasks.get(key) is task:
                del self._tasks[key]
