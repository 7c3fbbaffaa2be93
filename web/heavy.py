"""Reads whose cost grows with a run's length (its whole series, its CSV), rationed.

One such read folds a long run's every stored chunk: seconds of CPU and tens of MB while it
runs (daemon/runs/series_fold.py). Anyone may read them, so without a bound eight anonymous
clients reading at once took the node's memory from 255 to 729 MB and /healthz to seconds
(issue 40.5). They run one at a time on the node, on a thread of their own, the rest waiting
their turn, and a client may have at most :data:`PER_CLIENT` running or waiting: past that it
gets 429 with ``Retry-After``, at once, so a burst costs the node nothing but the refusals.

One thread, not the web server's pool: each thread allocates from a malloc arena of its own
and keeps its high-water mark, so twelve reads landing on twelve pool threads left the daemon
+126 MB after they were done, where one thread reuses one arena (bench/load.py --hostile);
and after each read that arena's free memory goes back to the system (glibc's malloc_trim).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, TypeVar

from fastapi import Depends, HTTPException, Request, status

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")
PER_CLIENT = 4


class HeavyReads:
    def __init__(self, *, per_client: int = PER_CLIENT) -> None:
        # the node's cores train; one more busy core is what a page may take
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="traind-heavy")
        self._per_client = per_client
        self._clients: Counter[str] = Counter()

    async def run(self, client: str, read: Callable[[], T]) -> T:
        """``read()`` on the heavy reads' thread, in turn; 429 when ``client`` already has
        its share running or waiting."""
        if self._clients[client] >= self._per_client:
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"at most {self._per_client} reads of a whole run's series or CSV per client "
                "at a time; retry once one has been answered", headers={"Retry-After": "1"})
        self._clients[client] += 1
        done = asyncio.get_running_loop().run_in_executor(self._thread, _trimmed, read)
        # Released when the read is done, not when its client leaves: a client that hangs
        # up keeps its share until the work it queued has run.
        done.add_done_callback(lambda _: self._release(client))
        return await asyncio.shield(done)

    def _release(self, client: str) -> None:
        self._clients[client] -= 1
        if not self._clients[client]:
            del self._clients[client]


def _trimmed(read: Callable[[], T]) -> T:
    try:
        return read()
    finally:
        _trim()


def _trim() -> None:
    """Hand the freed heap back to the system (glibc; elsewhere nothing to do)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def get_heavy(request: Request) -> HeavyReads:
    heavy: HeavyReads = request.app.state.heavy
    return heavy


HeavyDep = Annotated[HeavyReads, Depends(get_heavy)]
