"""Reads whose cost grows with a run's length (its whole series, its CSV), rationed.

One such read folds a long run's every stored chunk: seconds of CPU and tens of MB while it
runs (daemon/runs/series_fold.py). Anyone may read them, so without a bound eight anonymous
clients reading at once took the node's memory from 255 to 729 MB and /healthz to seconds
(issue 40.5). They run :data:`AT_ONCE` at a time on the node, the rest waiting their turn, and
a client may have at most :data:`PER_CLIENT` running or waiting: past that it gets 429 with
``Retry-After``, at once, so a burst costs the node nothing but the refusals.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, HTTPException, Request, status

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

AT_ONCE = 1  # the node's two cores train; one more busy core is what a page may take
PER_CLIENT = 4


class HeavyReads:
    def __init__(self, *, at_once: int = AT_ONCE, per_client: int = PER_CLIENT) -> None:
        self._turns = asyncio.Semaphore(at_once)
        self._per_client = per_client
        self._clients: Counter[str] = Counter()

    @asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        """Wait for this read's turn; 429 when ``client`` already has its share."""
        if self._clients[client] >= self._per_client:
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"at most {self._per_client} reads of a whole run's series or CSV per client "
                "at a time; retry once one has been answered", headers={"Retry-After": "1"})
        self._clients[client] += 1
        try:
            async with self._turns:
                yield
        finally:
            self._clients[client] -= 1
            if not self._clients[client]:
                del self._clients[client]


def get_heavy(request: Request) -> HeavyReads:
    heavy: HeavyReads = request.app.state.heavy
    return heavy


HeavyDep = Annotated[HeavyReads, Depends(get_heavy)]
