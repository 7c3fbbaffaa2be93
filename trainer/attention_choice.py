"""Which sliding-window attention implementation runs: measured at first use, per shape.

``attend`` (trainer/attention.py) has up to three implementations of the same rule. Which one
is fastest depends on the device, dtype, shape, window and sinks, and no fixed preference is
right everywhere (bench/attention.py prints the figures). So at the first call for a given
``ChoiceKey`` every candidate that can run there is timed on copies of that call's inputs
(forward and backward when gradients are on, a few warm-up calls, then the median of a few
timed ones), ``pick`` takes the fastest, and the answer is kept in a process-wide cache: later
calls are one dict lookup.

- Only what can run is timed (``candidates``): SDPA with a mask anywhere; on CUDA also the
  Triton kernel (where triton is installed) and compiled flex_attention. Neither of those has
  dropout. Off CUDA SDPA is the only candidate, so nothing is timed at all: flex has no CPU
  backward in torch 2.13, even compiled (``NotImplementedError``), so it cannot train there.
  Its compiled forward could serve evaluation (``bench/attention.py --cpu-flex-forward``, on
  this project's loaded 2-core machine: 0.9-2.7x SDPA-with-mask's forward at B=4, nh=4, hs=32,
  T=128-1024), but only after 30 s of compile for the first shape in a process and 7 s for
  each further one: a cost a short job (the test suite runs hundreds) never earns back. So
  the test suite never pays for a measurement either.
- A candidate that raises while being timed is skipped, with one warning.
- Inside a ``torch.compile`` trace nothing is timed: the choice comes from the cache or, when
  the shape was never measured eagerly, from ``static_choice`` (the order of preference).
- Each rank measures for itself, so two ranks may pick different implementations of the same
  attention when their times are close. That is harmless: they compute the same function to
  within rounding, and the gradients are averaged anyway. ``pick`` keeps the earlier
  candidate unless a later one is faster by more than ``MARGIN``, which makes such splits rare.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

Name = Literal["sdpa_mask", "triton", "flex"]

# A later candidate must beat the current pick by more than this share: measurement noise of a
# few percent must not flip the choice (nor split ranks), and the earlier candidates are the
# simpler ones.
MARGIN = 0.05


@dataclass(frozen=True)
class ChoiceKey:
    """Everything a candidate's speed depends on."""

    device: str  # "cuda:0", "cpu"
    dtype: torch.dtype
    shape: tuple[int, ...]  # q's (B, nh, T, hs)
    window: int
    global_tokens: int
    grad: bool  # forward and backward are timed, or the forward alone
    fp32_precision: str  # "tf32" makes fp32 matmuls several times faster on CUDA


@dataclass(frozen=True)
class Decision:
    """A measured choice: the winner, and each candidate's seconds (None: it failed)."""

    name: Name
    seconds: tuple[tuple[Name, float | None], ...]


def candidates(*, device_type: str, has_triton: bool, has_flex: bool,
               dropout: bool) -> tuple[Name, ...]:
    """The implementations that can run, in order of preference on a tie (see ``pick``).

    SDPA with a mask comes first: it runs everywhere, with dropout. The Triton kernel and
    compiled flex are CUDA only (the module docstring says why flex is not timed on CPU), and
    neither has dropout.
    """
    if device_type != "cuda" or dropout:
        return ("sdpa_mask",)
    return ("sdpa_mask", *(("triton",) if has_triton else ()), *(("flex",) if has_flex else ()))


def static_choice(names: tuple[Name, ...]) -> Name:
    """The choice when nothing may be timed (inside a compile trace): the Triton kernel, then
    flex, then SDPA, the order bench/attention.py measures on CUDA."""
    for name in ("triton", "flex", "sdpa_mask"):
        if name in names:
            return name
    raise ValueError(f"no attention candidate among {names}")


def pick(seconds: Mapping[Name, float | None], margin: float = MARGIN) -> Name | None:
    """The fastest candidate that ran (None: none did), in the mapping's order of preference:
    a later one replaces the current pick only when faster by more than ``margin``."""
    best: Name | None = None
    best_s = 0.0
    for name, s in seconds.items():
        if s is None:
            continue
        if best is None or s < best_s * (1.0 - margin):
            best, best_s = name, s
    return best


def median_seconds(trial: Callable[[], object], *, sync: Callable[[], None],
                   clock: Callable[[], float] = time.perf_counter, warmup: int = 2,
                   reps: int = 5) -> float:
    """Median seconds of ``trial`` after ``warmup`` untimed calls (which also pay for any
    compilation); ``sync`` waits for the device, so queued kernels are counted."""
    for _ in range(warmup):
        trial()
    times = []
    for _ in range(reps):
        sync()
        t0 = clock()
        trial()
        sync()
        times.append(clock() - t0)
    return statistics.median(times)


def device_timer(device: torch.device) -> Callable[[Name, Callable[[], object]], float]:
    """``median_seconds`` with the device's synchronisation."""
    if device.type == "cuda":
        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        def sync() -> None:
            return None
    return lambda _name, trial: median_seconds(trial, sync=sync)


class BackendChoice:
    """The process-wide cache of measured choices (``attend`` holds one, ``CHOICE``); tests
    build their own with a fake ``timer``."""

    def __init__(self, timer: Callable[[Name, Callable[[], object]], float] | None = None
                 ) -> None:
        self._timer = timer
        self._decided: dict[ChoiceKey, Decision] = {}
        self._warned: set[Name] = set()

    def decided(self) -> dict[ChoiceKey, Decision]:
        """A copy of every measured choice so far (for logs and benches)."""
        return dict(self._decided)

    def choose(self, key: ChoiceKey, names: tuple[Name, ...],
               trial: Callable[[Name], Callable[[], object]]) -> Name:
        """The implementation to run for ``key``: the only candidate, the cached choice, or,
        at the first use, the fastest of ``names`` timed with ``trial(name)``'s calls."""
        if len(names) == 1:
            return names[0]
        known = self._decided.get(key)
        if known is not None:
            return known.name
        if torch.compiler.is_compiling():
            return static_choice(names)  # timing inside a trace would time the tracer
        decision = self._measure(key, names, trial)
        self._decided[key] = decision
        log.info("attention backend for %s: %s (%s)", key, decision.name, ", ".join(
            f"{n} {'failed' if s is None else f'{s * 1e3:.3f} ms'}" for n, s in decision.seconds))
        return decision.name

    def _measure(self, key: ChoiceKey, names: tuple[Name, ...],
                 trial: Callable[[Name], Callable[[], object]]) -> Decision:
        timer = self._timer or device_timer(torch.device(key.device))
        seconds: dict[Name, float | None] = {}
        for name in names:
            try:
                seconds[name] = timer(name, trial(name))
            except Exception as exc:  # any failure means: not this one
                seconds[name] = None
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(f"attention backend {name!r} failed at first use and is "
                                  f"skipped: {type(exc).__name__}: {exc}", stacklevel=4)
        # nothing ran: the first candidate is returned and raises its own error when called
        return Decision(pick(seconds) or names[0], tuple(seconds.items()))
