"""A profile on demand: ``torch.profiler`` over a few steps of a running job, when asked.

The daemon asks with a request file (contracts/control.PROFILE_REQUEST); rank 0 sees it
(:meth:`StepProfiler.asked`) at a report step, the loop agrees on it with the other ranks (the
all-reduce it makes there anyway) and :meth:`StepProfiler.take_request` hands it to every
rank. From the next step on, each chosen rank traces
``steps`` whole steps, each inside a ``traind.step#<n>`` annotation (the report's windows: the
profiler's own ``ProfilerStep#`` marks need a schedule and would not carry the training step),
then writes its Chrome trace, gzipped, to ``profiles/<capture>/rank<r>.json.gz`` (one rename:
the daemon never reads half a trace) and sends a ``profiled`` lifecycle event naming the file.
The daemon builds the report when every chosen rank has sent one (daemon/profiles/).

Activities: the CPU always, CUDA where the job runs on it (kernels on the device timeline are
what the report splits into compute and communication there); memory and shapes on; Python
stacks off (they multiply a trace's size and its overhead). A rank not chosen only counts the
steps, so every rank knows when the capture is over and the next request may be taken.
A failure to trace is reported in the event (``error``) and never stops training.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from traind.contracts.control import PROFILE_DIR, PROFILE_REQUEST, read_profile_request
from traind.contracts.events import LifecycleEvent
from traind.trainer import distributed

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from traind.contracts.control import ProfileRequest
    from traind.trainer.distributed import DistInfo
    from traind.trainer.ledger import Ledger

STEP_MARK = "traind.step#"  # + the training step: one annotation per traced step


def activities(device_type: str) -> list[ProfilerActivity]:
    """What to trace on a rank whose device is of ``device_type``."""
    out = [ProfilerActivity.CPU]
    if device_type == "cuda":
        out.append(ProfilerActivity.CUDA)
    return out


def trace_name(rank: int) -> str:
    return f"rank{rank}.json.gz"


def capture_dir(out_dir: Path, capture: int) -> Path:
    return out_dir / PROFILE_DIR / str(capture)


class StepProfiler:
    def __init__(self, *, rank: int, device_type: str, out_dir: Path | None,
                 emit: Callable[[Any], None], ledger: Ledger,
                 clock_offset: Callable[[], float]) -> None:
        """``clock_offset``: this rank's clock against rank 0's (trainer/clocksync.py), read
        when the trace is written, so the report can line the ranks' traces up."""
        self.rank, self.device_type, self.out_dir = rank, device_type, out_dir
        self.emit, self.ledger, self.clock_offset = emit, ledger, clock_offset
        self.request: ProfileRequest | None = None
        self._counted = 0
        self._first = 0
        self._prof: profile | None = None
        self._mark: record_function | None = None

    @property
    def busy(self) -> bool:
        """A capture is armed or running (the same on every rank: armed at the same step)."""
        return self.request is not None

    def arm(self, request: ProfileRequest) -> None:
        """Trace the next ``request.steps`` steps (on the chosen ranks)."""
        self.request, self._counted, self._first = request, 0, 0

    def asked(self) -> bool:
        """Rank 0, at a report step: a request waits and no capture is under way."""
        return (self.request is None and self.out_dir is not None
                and (self.out_dir / PROFILE_REQUEST).exists())

    def take_request(self, info: DistInfo) -> None:
        """Every rank, once they agreed one was asked: rank 0 reads the request and hands it
        to every rank (a collective), then removes it; every rank arms for the next steps. A
        malformed request is dropped with a line in the log (the daemon writes them whole:
        only a person could write one)."""
        request = None
        if info.rank == 0 and self.out_dir is not None:
            path = self.out_dir / PROFILE_REQUEST
            try:
                request = read_profile_request(path)
            except ValueError as exc:
                print(f"rank 0: {exc}; ignored", file=sys.stderr, flush=True)
            path.unlink(missing_ok=True)
        request = distributed.all_gather(request, info)[0]
        if request is not None:
            self.arm(request)

    def begin(self, step: int) -> None:
        """A step starts."""
        if self.request is None or not self._traces():
            return
        if self._prof is None:
            self._first = step
            try:
                self._prof = profile(activities=activities(self.device_type),
                                     record_shapes=True, profile_memory=True,
                                     with_stack=False)
                self._prof.start()
            except Exception as exc:  # reported, never raised into the loop
                self._prof = None
                self._done(step, error=f"the profiler did not start: {exc}")
                return
        self._mark = record_function(f"{STEP_MARK}{step}")
        self._mark.__enter__()

    def end(self, step: int) -> None:
        """A step ends (a rollback's too: it was traced)."""
        if self.request is None:
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        self._counted += 1
        if self._counted >= self.request.steps:
            self._finish(step)

    def close(self, step: int) -> None:
        """The loop ended (a stop) in the middle of a capture: write what was traced."""
        if self._prof is not None:
            self._finish(step)
        self.request = None

    def _traces(self) -> bool:
        return (self.request is not None and self.out_dir is not None
                and self.request.chooses(self.rank))

    def _finish(self, step: int) -> None:
        prof = self._prof
        if prof is None:  # not chosen (or it failed to start: already reported)
            self.request = None
            return
        self._prof = None
        with self.ledger.span("profile"):
            try:
                if self.device_type == "cuda":
                    torch.cuda.synchronize()  # the traced steps' kernels, finished
                prof.stop()
                assert self.out_dir is not None and self.request is not None
                folder = capture_dir(self.out_dir, self.request.capture)
                folder.mkdir(parents=True, exist_ok=True)
                final = folder / trace_name(self.rank)
                t0 = time.perf_counter()
                write_trace(prof, final)
            except Exception as exc:  # reported; training carries on
                self._done(step, error=f"the trace was not written: {exc}")
                return
        self._done(step, file=final.name, export_seconds=time.perf_counter() - t0)

    def _done(self, step: int, **detail: Any) -> None:
        request = self.request
        assert request is not None
        self.request, self._mark = None, None
        self.emit(LifecycleEvent(rank=self.rank, phase="profiled", step=step, detail={
            "capture": request.capture, "steps": request.steps,
            "first_step": self._first or step, "last_step": step,
            "clock_offset": self.clock_offset(), **detail}))


def write_trace(prof: profile, final: Path) -> None:
    """``prof``'s Chrome trace, gzipped, at ``final`` (one rename: a reader never sees half a
    trace). Gzipped here, not by torch: torch names its own temporary file (/tmp/tmp....json)
    in the gzip header of every download; ours names the trace (``rank0.json``)."""
    plain = final.with_name(f".{final.stem}.{os.getpid()}.tmp")
    packed = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        prof.export_chrome_trace(str(plain))  # no .gz suffix: torch writes it as it is
        with open(plain, "rb") as src, open(packed, "wb") as raw, gzip.GzipFile(
                filename=final.stem, mode="wb", fileobj=raw) as gz:
            shutil.copyfileobj(src, gz, 1 << 20)
        os.replace(packed, final)
    finally:
        plain.unlink(missing_ok=True)
        packed.unlink(missing_ok=True)
