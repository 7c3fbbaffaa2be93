"""Per-collective timing by operation and message size, binned on the rank that ran it.

Every gradient collective the DDP hook starts is recorded here as ``(op, bytes, seconds)``,
and what leaves the rank at a report is, per ``(op, size bucket)``, a call count, a byte count,
the summed seconds and a latency histogram already binned with :data:`LATENCY_BOUNDS`: a
window of steps costs a few small lists, however many buckets it had, and the daemon adds the
counts into a Prometheus histogram without seeing single calls.

On CUDA the host must not wait for a collective to time it (DeepSpeed's comms logger
synchronises after every op, which is exactly the stall we refuse). There a call is a pair of
CUDA events recorded on the stream around the collective and read in :meth:`CollectiveLog.take`,
which the trainer calls at a report, after the step's own synchronisation point: the events
have completed by then and reading them costs no extra wait.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where events are recorded: the catalog reads the bounds
    import torch

KIB, MIB = 2**10, 2**20
# Message-size buckets (upper bounds, bytes): the probe's range, 4 KiB to 64 MiB, by 16x.
SIZE_BOUNDS = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB)
SIZE_LABELS = ("4KiB", "64KiB", "1MiB", "16MiB", "64MiB", "inf")
# Latency bounds (seconds): a gloo all-reduce of 4 KiB over loopback is ~50 us, a 64 MiB one
# across a slow link is seconds; NVLink brings small messages under 10 us.
LATENCY_BOUNDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def size_bucket(nbytes: int) -> str:
    """The label of the smallest size bucket that holds a message of ``nbytes``."""
    return SIZE_LABELS[bisect.bisect_left(SIZE_BOUNDS, nbytes)]


def latency_bin(seconds: float) -> int:
    """Index of the latency bucket for ``seconds`` (le semantics; the last is +Inf)."""
    return bisect.bisect_left(LATENCY_BOUNDS, seconds)


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


def _recorded_event() -> torch.cuda.Event:
    # Imported here, not at the top: the metric catalog imports this module for its bounds,
    # and the daemon's import of it must not pay for torch.
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class CollectiveLog:
    """Collectives of one rank since the last :meth:`take`; safe to call from the backend's
    callback threads. ``record`` takes host-measured seconds; ``start``/``stop`` a CUDA pair."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bins: dict[tuple[str, str], _Bin] = {}
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []

    def record(self, op: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bins.setdefault((op, size_bucket(nbytes)), _Bin()).add(nbytes, seconds)

    @staticmethod
    def start_event() -> torch.cuda.Event:
        """A timing event recorded now on the current stream (before the collective)."""
        return _recorded_event()

    def stop(self, op: str, nbytes: int, started: torch.cuda.Event) -> None:
        """Close a CUDA pair: the end event is recorded where the stream has waited for the
        collective (the hook's future callback), and read later in ``take``."""
        end = _recorded_event()
        with self._lock:
            self._pending.append((op, nbytes, started, end))

    def take(self) -> list[dict[str, Any]]:
        """One dict per (op, size bucket) since the last call (``op``, ``size``, ``calls``,
        ``bytes``, ``seconds``, ``counts`` per latency bucket, the last one +Inf)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for op, nbytes, start, end in pending:
            end.synchronize()  # complete at a report already: the step has synchronised
            self.record(op, nbytes, start.elapsed_time(end) / 1000.0)
        with self._lock:
            bins, self._bins = self._bins, {}
        return [{"op": op, "size": size, "calls": b.calls, "bytes": b.bytes,
                 "seconds": b.seconds, "counts": b.counts}
                for (op, size), b in sorted(bins.items())]
