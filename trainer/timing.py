"""Per-phase step timing that never makes the host wait for the device except when read.

On the CPU every op has finished when it returns, so ``time.perf_counter`` marks are exact. On
CUDA the host runs ahead of the GPU, so marks are CUDA events recorded on the stream; they are
read (one ``synchronize`` on the last event) only on telemetry steps, and on other steps nothing
is recorded at all.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class PhaseTimer:
    """``start()``, then ``mark(name)`` at the end of each phase, then ``read()``.
    ``cuda``: ``torch.cuda`` (default) or a stand-in with its ``Event`` (tests)."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.cuda = device.type == "cuda"
        self._events = cuda or torch.cuda
        self.enabled = False
        self._marks: list[tuple[str, float | torch.cuda.Event]] = []

    def start(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._marks = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            event = self._events.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def read(self) -> dict[str, float]:
        """Seconds spent in each marked phase, plus ``"total"`` from start to the last mark."""
        if not self.enabled or len(self._marks) < 2:
            return {}
        if self.cuda:
            self._marks[-1][1].synchronize()  # type: ignore[union-attr]

        def span(a: float | torch.cuda.Event, b: float | torch.cuda.Event) -> float:
            if isinstance(a, float) and isinstance(b, float):
                return b - a
            return a.elapsed_time(b) / 1000.0  # type: ignore[union-attr,arg-type]

        out: dict[str, float] = {}
        for (_, prev), (name, cur) in zip(self._marks, self._marks[1:], strict=False):
            out[name] = out.get(name, 0.0) + span(prev, cur)  # a phase may repeat (micro-batches)
        out["total"] = span(self._marks[0][1], self._marks[-1][1])
        return out
