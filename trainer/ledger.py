"""Where one worker's time went, since its process started: the worker's half of goodput.

The daemon cannot see inside a worker: a checkpoint save, an evaluation or a restore look the
same from outside as training. So each worker keeps a ledger of its own seconds, cumulative
since its process started, and every step report carries a snapshot of it
(``StepEvent.clock``, and the finished event's ``detail["clock"]``). The daemon folds the
snapshots of a run's attempts, with what only it knows (when it launched the job, when a
failed attempt's successor started, when the job ended), into goodput and badput
(``metrics/goodput.py``, the one definition of those figures).

A snapshot's kinds partition the process's life up to the snapshot's time exactly:
``setup`` (process start to the first step, less a resume's restore), ``restore``,
``checkpoint``, ``eval``, ``numerics`` (steps whose update was skipped), ``profile``
(writing a trace asked for on demand), ``data`` (the loop
waiting for batches) and ``train``: the rest of the loop's time, the candidate for goodput.
Which of ``train`` was lost (steps redone after a restart or a rollback) only the daemon can
say, once it sees the rewind. ``started`` (the process's start) and ``time`` are unix times.

Cost: two ``perf_counter`` calls per span, and a few additions per report; nothing per step
but the check for a skipped update.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from collections.abc import Iterator

SPANS = ("restore", "checkpoint", "eval", "numerics", "profile")
KINDS = ("setup", *SPANS, "data", "train")


def process_start() -> float:
    """This process's start, unix time (the kernel's record: before the interpreter's
    imports, which are start-up too). On Linux from its start in clock ticks since boot
    against the boot clock now (10 ms): psutil's ``create_time`` adds the boot time, which
    the kernel gives in whole seconds, and would be up to a second off the wall clock."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf(
            "SC_CLK_TCK")  # field 22 of stat(5): starttime
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return float(psutil.Process().create_time())


@dataclass(slots=True)
class Ledger:
    started: float = field(default_factory=process_start)  # unix
    spans: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    # the loop's first step, by perf_counter, and the restore seconds spent before it
    _loop_start: float | None = None
    _restore_before_loop: float = 0.0
    # perf_counter and unix time read together once, so snapshots mix no clocks
    _origin: tuple[float, float] = field(
        default_factory=lambda: (time.perf_counter(), time.time()))

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Count the body's seconds as ``kind`` (one of :data:`SPANS`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - t0)

    def add(self, kind: str, seconds: float) -> None:
        if kind not in self.spans:
            raise ValueError(f"ledger kind {kind!r} is none of {SPANS}")
        self.spans[kind] += max(0.0, seconds)

    def loop_started(self) -> None:
        """The first step begins: what came before (less a restore) was setup."""
        if self._loop_start is None:
            self._loop_start = time.perf_counter()
            self._restore_before_loop = self.spans["restore"]

    def _unix(self, perf: float) -> float:
        return self._origin[1] + (perf - self._origin[0])

    def snapshot(self, data_wait: float) -> dict[str, float]:
        """Every kind's seconds now, and ``started`` and ``time`` (unix). ``data_wait``: the
        loop's cumulative wait for batches (the data pipeline counts it)."""
        now = time.perf_counter()
        unix_now = self._unix(now)
        out = {"started": self.started, "time": unix_now, **self.spans}
        if self._loop_start is None:  # before the first step: all of it is setup
            out["setup"] = max(0.0, unix_now - self.started - self.spans["restore"])
            out["data"] = out["train"] = 0.0
            return out
        loop = now - self._loop_start
        in_loop = sum(self.spans.values()) - self._restore_before_loop
        out["setup"] = max(0.0, self._unix(self._loop_start) - self.started
                           - self._restore_before_loop)
        out["data"] = max(0.0, min(data_wait, loop - in_loop))
        out["train"] = max(0.0, loop - in_loop - out["data"])
        return out
