"""The collective log's CUDA path on CPU, through a fake event clock.

On a GPU a collective is timed by a pair of ``torch.cuda.Event``s; nothing here has CUDA, so
``torch.cuda.Event`` is replaced by a fake whose clock the test sets. Every line of the CUDA
path runs, so a name that only exists under ``TYPE_CHECKING`` (the bug TC004 now catches) fails
here, not on the first multi-GPU backward.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from traind.trainer.collectives import CollectiveLog


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


def test_cuda_pairs_are_read_at_take_without_waiting_at_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    log = CollectiveLog()
    FakeEvent.now_ms = 10.0
    started = log.start_event()
    FakeEvent.now_ms = 12.5  # the collective took 2.5 ms on the stream
    log.stop("all_reduce", 100_000, started)
    FakeEvent.now_ms = 20.0
    second = log.start_event()
    FakeEvent.now_ms = 20.04
    log.stop("all_reduce", 100_000, second)
    pending = list(log._pending)
    assert not any(end.synchronized for *_, end in pending)  # stop never waits
    (window,) = log.take()
    assert all(end.synchronized for *_, end in pending)
    assert window["op"] == "all_reduce" and window["size"] == "1MiB"
    assert window["calls"] == 2 and window["bytes"] == 200_000
    assert window["seconds"] == pytest.approx(2.54e-3)
    assert log.take() == []


def test_the_bounds_import_without_torch() -> None:
    # The metric catalog reads the bounds in the daemon: importing them must not load torch.
    code = ("import sys; import traind.trainer.collectives as c; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(c.LATENCY_BOUNDS[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
