"""The collective log: one device-agnostic piece of code, two clocks, a test for each.

On a GPU a collective is stamped by ``torch.cuda.Event``s; nothing here has CUDA, so
``torch.cuda.Event`` is replaced by a fake whose clock the test sets. Every line of the CUDA
path runs, so a name that only exists under ``TYPE_CHECKING`` (the bug TC004 now catches) fails
here, not on the first multi-GPU backward.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from traind.trainer.collectives import (
    CollectiveLog,
    EventClock,
    HostClock,
    clock_for,
    union_seconds,
)


class FakeEvent:
    """``torch.cuda.Event`` with a settable clock: ``record`` stamps the current time."""

    now_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.at: float | None = None
        self.synchronized = False

    def record(self) -> None:
        self.at = FakeEvent.now_ms

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "both events must be recorded"
        return end.at - self.at


class FakeHostClock(HostClock):
    """``HostClock`` whose now the test sets (perf_counter stamps are what it returns)."""

    now = 0.0

    def stamp(self) -> float:
        return self.now


@pytest.mark.parametrize(("intervals", "union"), [
    ([], 0.0),
    ([(0.0, 1.0)], 1.0),
    ([(0.0, 1.0), (2.0, 3.0)], 2.0),  # disjoint: the sum
    ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping: counted once
    ([(1.0, 3.0), (0.0, 4.0)], 4.0),  # nested, given out of order
    ([(-2.0, -1.0), (-1.0, 0.5)], 2.5),  # touching; negative offsets (an origin after them)
])
def test_union_of_intervals(intervals: list[tuple[float, float]], union: float) -> None:
    assert union_seconds(intervals) == pytest.approx(union)


def test_host_clock_busy_time_is_the_union_and_calls_are_each_interval() -> None:
    clock = FakeHostClock()
    log = CollectiveLog(clock)
    clock.now = 1.0
    a = log.start()
    clock.now = 1.5
    b = log.start()  # two collectives in flight at once (gloo's two worker threads)
    clock.now = 3.0
    log.stop("all_to_all", 1000, a)  # 2.0 s
    clock.now = 4.0
    log.stop("all_gather", 500, b)  # 2.5 s
    window, busy = log.take_window()
    assert busy == pytest.approx(3.0)  # 1.0 .. 4.0, not 4.5
    by_op = {w["op"]: w for w in window}
    assert by_op["all_to_all"]["seconds"] == pytest.approx(2.0)
    assert by_op["all_gather"]["seconds"] == pytest.approx(2.5)
    assert by_op["all_to_all"]["calls"] == by_op["all_gather"]["calls"] == 1
    assert log.take_window() == ([], 0.0)


def test_cuda_pairs_are_read_at_take_without_waiting_at_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    log = CollectiveLog(EventClock())
    FakeEvent.now_ms = 10.0
    started = log.start()
    FakeEvent.now_ms = 12.5  # the collective took 2.5 ms on the stream
    log.stop("all_reduce", 100_000, started)
    FakeEvent.now_ms = 20.0
    second = log.start()
    FakeEvent.now_ms = 20.04
    log.stop("all_reduce", 100_000, second)
    pending = list(log._pending)
    assert not any(end.synchronized for *_, end in pending)  # stop never waits
    (window,), busy = log.take_window()
    assert all(end.synchronized for *_, end in pending)
    assert window["op"] == "all_reduce" and window["size"] == "1MiB"
    assert window["calls"] == 2 and window["bytes"] == 200_000
    assert window["seconds"] == pytest.approx(2.54e-3)
    assert busy == pytest.approx(2.54e-3)  # on one stream: disjoint, the union is the sum
    assert log.take() == []


def test_each_device_gets_its_clock() -> None:
    assert isinstance(clock_for("cpu"), HostClock)
    assert isinstance(clock_for("cuda"), EventClock)


def test_the_bounds_import_without_torch() -> None:
    # The metric catalog reads the bounds in the daemon: importing them must not load torch.
    code = ("import sys; import traind.trainer.collectives as c; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(c.LATENCY_BOUNDS[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
