"""A pipeline stage's activation traffic: what crosses its boundaries, and how long it waited.

The bytes come from the P2P ops the schedule asks each stage for (``PipelineStage``'s
``get_fwd_send_ops`` and the like, counted by trainer/pipeline_parallel.py's ``TimedStage``):
one tensor per micro-batch and boundary, its shape known. The time is the host time the
schedule blocked in each op's ``wait()``: torch.distributed.pipelining issues the ops through
its module function ``_batch_p2p`` and waits on the works it returns, so for the length of
one step (:func:`timing_p2p`) that function hands back works that time their wait. A recv's
wait is its neighbour's compute and the transfer together (the stage cannot tell them apart
on the host); a send's ends once the peer has taken it. Where a backend coalesces a batch
into fewer works than ops (NCCL), each work's wait is split evenly over the batch's ops.

Patching a private function of PyTorch is the price of the time: without it (another torch
that lacks it) the stage still counts bytes and reports no time.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

# A stage's tally per (direction, op): [messages, bytes, seconds waited]
Tally = list[Any]


def p2p_totals(counts: Iterable[dict[tuple[str, str], Tally]], *, timed: bool = True
               ) -> list[dict[str, Any]]:
    """A rank's stages' tallies summed per (direction, op), as PipelineEvent.p2p's dicts
    (a looped rank's stages' traffic adds up: each of them has boundaries); ``seconds``
    only where the waits were ``timed``."""
    total: dict[tuple[str, str], Tally] = {}
    for stage in counts:
        for key, (calls, nbytes, seconds) in stage.items():
            acc = total.setdefault(key, [0, 0, 0.0])
            acc[0] += calls
            acc[1] += nbytes
            acc[2] += seconds
    return [{"direction": d, "op": op, "calls": c, "bytes": b,
             **({"seconds": s} if timed else {})}
            for (d, op), (c, b, s) in sorted(total.items())]


class _TimedWork:
    """A P2P work whose ``wait()`` adds the host seconds it blocked to its ops' tallies."""

    def __init__(self, work: Any, tallies: list[Tally]) -> None:
        self._work, self._tallies = work, tallies

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            share = (time.perf_counter() - t0) / len(self._tallies)
            for tally in self._tallies:
                tally[2] += share

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def timing_p2p(tags: dict[int, Tally]) -> Iterator[bool]:
    """Inside: the schedule's P2P works time their waits into the tally ``tags`` holds for
    each op (by ``id``, as the stage's op getters tagged them; ops not tagged are left
    alone). Yields whether the waits are timed (False: this torch has no ``_batch_p2p``)."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_batch_p2p", None)
    if original is None:
        yield False
        return

    def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = original(p2p_ops, desc=desc)
        found = [tags.pop(id(p), None) for p in p2p_ops]
        tallies = [t for t in found if t is not None]
        if not works or len(tallies) < len(found):
            return works
        if len(works) == len(p2p_ops):  # one work per op (gloo; NCCL's homogeneous batches)
            return [_TimedWork(w, [t]) for w, t in zip(works, tallies, strict=True)]
        return [_TimedWork(w, tallies) for w in works]

    schedules._batch_p2p = batch_p2p
    try:
        yield True
    finally:
        schedules._batch_p2p = original
        tags.clear()
