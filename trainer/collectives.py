"""Per-collective timing by operation and message size, binned on the rank that ran it.

Every gradient collective the DDP hook starts is recorded here: a start stamp before it is
issued, an end stamp when its future completes, on a :class:`Clock` the device supplies. What
leaves the rank at a report is, per ``(op, size bucket)``, a call count, a byte count (what
the rank handed the collectives: measured, not bytes on the wire), the summed seconds and a
latency histogram already binned with ``contracts.comm``'s bounds (a window costs a few small
lists however many buckets it had), plus the window's *busy* seconds: the union of all
collective intervals, the time some gradient collective was in flight.

Why the union and not the sum: gloo runs collectives on two worker threads, so two buckets'
collectives can be in flight at once, and a start stamp is taken when a collective is queued,
so on one NCCL stream its interval also covers the wait behind the one before. Summing would
count those instants twice; the union is the wall-clock share of the step spent in
communication, which is what ``traind_comm_allreduce_seconds`` means. Per-call latencies (the
histogram) are each interval on its own, queueing included.

The code is the same on every device; only the clock differs:

- :class:`HostClock` (CPU, gloo): ``perf_counter`` stamps. The end stamp is taken in the
  future's callback, which gloo runs when the collective has finished.
- :class:`EventClock` (CUDA, NCCL): the host must not wait for a collective to time it
  (DeepSpeed's comms logger synchronises after every op, the stall we refuse). A stamp is a
  CUDA event recorded on the current stream; the end one in the future's callback, where the
  stream has been made to wait for the collective. Events are read in :meth:`CollectiveLog.
  take`, at a report, after the step's own synchronisation: they are complete and reading
  them costs no extra wait.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from traind.contracts.comm import LATENCY_BOUNDS, latency_bin, size_bucket

if TYPE_CHECKING:  # torch is imported where events are recorded: the catalog reads the bounds
    import torch

def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Clock(Protocol):
    """Where a collective's start and end are stamped, and how two stamps become seconds."""

    def stamp(self) -> Any:
        """A mark of now (on the host, or on the device's current stream)."""

    def between(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (negative if ``end`` came first); called only at
        :meth:`CollectiveLog.take`, when both have completed."""


class HostClock:
    """``perf_counter`` stamps: exact where the future completes when the collective has."""

    def stamp(self) -> float:
        return time.perf_counter()

    def between(self, start: float, end: float) -> float:
        return end - start


class EventClock:
    """CUDA timing events recorded on the current stream, read after the step's sync."""

    def stamp(self) -> torch.cuda.Event:
        # Imported here, not at the top: the metric catalog imports this module for its
        # bounds, and the daemon's import of it must not pay for torch.
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # complete at a report already: the step has synchronised
        start.synchronize()
        return start.elapsed_time(end) / 1000.0


def clock_for(device_type: str) -> Clock:
    """The clock for collectives on tensors of ``device_type``."""
    return EventClock() if device_type == "cuda" else HostClock()


@dataclass(slots=True)
class _Bin:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))

    def add(self, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.counts[latency_bin(seconds)] += 1


class CollectiveLog:
    """Collectives of one rank since the last :meth:`take`; safe to call from the backend's
    callback threads. ``start``/``stop`` stamp an interval on the clock; ``record`` takes
    seconds already measured (for a caller with its own timing)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock  # None: set by the first user that knows the device
        self._lock = threading.Lock()
        self._bins: dict[tuple[str, str], _Bin] = {}
        self._pending: list[tuple[str, int, Any, Any]] = []

    def record(self, op: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bins.setdefault((op, size_bucket(nbytes)), _Bin()).add(nbytes, seconds)

    def start(self) -> Any:
        """A stamp taken just before a collective is issued."""
        assert self.clock is not None, "CollectiveLog.clock must be set before start()"
        return self.clock.stamp()

    def stop(self, op: str, nbytes: int, started: Any) -> None:
        """Close an interval where the collective is known complete (its future's callback).
        Never waits: the stamps are turned into seconds in :meth:`take`."""
        assert self.clock is not None
        end = self.clock.stamp()
        with self._lock:
            self._pending.append((op, nbytes, started, end))

    def take_window(self) -> tuple[list[dict[str, Any]], float]:
        """One dict per (op, size bucket) since the last call (``op``, ``size``, ``calls``,
        ``bytes``, ``seconds``, ``counts`` per latency bucket, the last one +Inf), and the
        union of the stamped intervals in seconds (see the module's docstring)."""
        with self._lock:
            pending, self._pending = self._pending, []
        intervals: list[tuple[float, float]] = []
        if pending:
            assert self.clock is not None
            origin = pending[0][2]  # any common origin will do: only differences matter
            for op, nbytes, start, end in pending:
                a, b = self.clock.between(origin, start), self.clock.between(origin, end)
                intervals.append((a, b))
                self.record(op, nbytes, max(0.0, b - a))
        with self._lock:
            bins, self._bins = self._bins, {}
        return ([{"op": op, "size": size, "calls": b.calls, "bytes": b.bytes,
                  "seconds": b.seconds, "counts": b.counts}
                 for (op, size), b in sorted(bins.items())], union_seconds(intervals))

    def take(self) -> list[dict[str, Any]]:
        """The per-(op, size) dicts of :meth:`take_window`."""
        return self.take_window()[0]


class UntimedLog(CollectiveLog):
    """``telemetry.collectives = false``: stamps nothing and reports no collective, so what
    the per-collective figures cost can be measured against it (bench/overhead.py --ranks)."""

    def start(self) -> None:
        return None

    def stop(self, op: str, nbytes: int, started: Any) -> None:
        return None
