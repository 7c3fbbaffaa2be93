"""Batches drawn ahead of the loop by a background thread, in exactly the sampler's order.

The sampler's batch ``i`` is a function of ``(seed, i)`` alone, so drawing it early on another
thread changes nothing about its contents. What the prefetcher must keep straight is *which*
batches the loop has consumed: that, not what the thread has produced, is the resumable state.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from types import TracebackType

    from traind.trainer.data import BatchSampler
    from traind.trainer.tiers import TierCounts

Batch = tuple[torch.Tensor, torch.Tensor]


# data.prefetch = "auto": on CUDA the host waits for the device at every telemetry step, and a
# batch drawn ahead overlaps that wait; on the CPU the loop's own threads are the compute, and
# the prefetch thread cost 9-11% of the tokens/s of traind run at the bench shape (bench/speed.py:
# 0.89x a bare loop with it, 0.99x without, paired over 3 rounds), for batches that take well
# under a millisecond to draw. Measured on the CPU only; the CUDA depth is the old default.
AUTO_DEPTH = {"cuda": 2}


def prefetch_depth(setting: int | str, device_type: str) -> int:
    """The prefetch depth ``data.prefetch`` asks for on ``device_type`` ("auto": by device)."""
    if setting == "auto":
        return AUTO_DEPTH.get(device_type, 0)
    if isinstance(setting, str) or setting < 0:
        raise ValueError(f"data.prefetch must be >= 0 or 'auto', got {setting!r}")
    return setting


class _Failed:
    """Carries an exception from the producer thread to the consumer's next()."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher:
    """``next()`` returns the sampler's batches in order; with ``depth > 0`` a thread keeps up
    to ``depth`` of them ready in a bounded queue. ``depth == 0`` draws in the caller.

    The thread starts at the first ``next()`` (so a ``load_state_dict`` right after building
    wastes nothing) and is joined by ``close()``, also via ``with``. Counters for telemetry:
    ``served``, ``depth_sum`` and ``last_depth`` (queue depth seen at each ``next()``), and
    ``wait_seconds`` (time ``next()`` spent waiting for a batch, or drawing it when
    synchronous).
    """

    def __init__(self, sampler: BatchSampler, depth: int, *, pin: bool = False,
                 counts: TierCounts | None = None) -> None:
        if depth < 0:
            raise ValueError(f"data.prefetch must be >= 0, got {depth}")
        self.sampler = sampler
        self.depth = depth
        # CUDA: batches in page-locked memory, so their copy to the device is asynchronous
        self.pin = pin
        self.counts = counts  # the host tier's (trainer/tiers.py): a batch ready is a hit
        self.consumed = sampler.index  # the next batch index the caller will get
        self.served = 0
        self.depth_sum = 0
        self.last_depth = 0
        self.wait_seconds = 0.0
        self._queue: queue.Queue[Batch | _Failed] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def next(self) -> Batch:
        """Inputs and targets, each int64 ``(B, T)``: batch number ``consumed``."""
        if self.depth == 0:
            t0 = time.perf_counter()
            batch = self._draw()
            self._served(0, time.perf_counter() - t0)
            return batch
        # A thread started by this call drew nothing ahead: its batch is a miss, however fast
        # the thread put it (reading qsize() after the start would race it).
        ready = 0
        if self._thread is None:
            self._start()
        else:
            ready = self._queue.qsize()
        t0 = time.perf_counter()
        item = self._queue.get()
        if isinstance(item, _Failed):
            self.close()
            raise RuntimeError("the prefetch thread failed drawing a batch") from item.exc
        self._served(ready, time.perf_counter() - t0)
        return item

    @property
    def ready(self) -> int:
        """Batches waiting in the queue now."""
        return self._queue.qsize() if self._thread is not None else 0

    def _served(self, ready: int, waited: float) -> None:
        if self.counts is not None:
            self.counts.count(ready > 0, waited)
        self.consumed += 1
        self.served += 1
        self.depth_sum += ready
        self.last_depth = ready
        self.wait_seconds += waited

    def state_dict(self) -> dict[str, Any]:
        # The sampler runs ahead by up to ``depth`` batches; a resume must replay those.
        return {**self.sampler.state_dict(), "index": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drop batches drawn ahead and continue from the restored index."""
        self.close()
        self.sampler.load_state_dict(state)
        self.consumed = self.sampler.index

    def close(self) -> None:
        """Stop and join the thread; drawn-ahead batches are discarded. Safe to call twice;
        a later ``next()`` starts a fresh thread from the consumed index."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        # Empty the queue so a producer blocked on a full one can finish its put, see the
        # flag and return; it puts at most one more batch, which the second drain takes.
        self._drain()
        thread.join()
        self._drain()
        self._stop = threading.Event()
        self.sampler.index = self.consumed

    def _start(self) -> None:
        self.sampler.index = self.consumed
        self._thread = threading.Thread(target=self._produce, args=(self._stop,),
                                        name="traind-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item: Batch | _Failed = self._draw()
            except Exception as exc:  # handed to the consumer, which raises it
                item = _Failed(exc)
            self._queue.put(item)
            if isinstance(item, _Failed):
                return

    def _draw(self) -> Batch:
        x, y = self.sampler.next()
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
