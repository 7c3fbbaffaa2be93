"""Numerics guard: non-finite losses and gradients, and loss spikes, found step by step.

The decisions are pure (:func:`inspect`, :func:`spike_limit`) and tested with tables of cases;
:class:`NumericsGuard` only keeps the rolling window of recent losses between steps. What the
job then does (``numerics.policy``: fail, skip_step, rollback) is the loop's part.

Every rank must take the same action at the same step, so the loop hands in values every rank
holds alike (the loss averaged over ranks by an all-reduce, and the global gradient norm):
identical inputs, identical windows, identical decisions, with no second round of agreement.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from traind.trainer.config import NumericsConfig

NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
LOSS_SPIKE = "loss_spike"


class NumericsError(RuntimeError):
    """The run met bad numerics under ``numerics.policy = fail`` (or ran out of rollbacks)."""


@dataclass(frozen=True, slots=True)
class Finding:
    reason: str  # nonfinite_loss | nonfinite_grad | loss_spike
    value: float  # the loss or gradient norm that tripped the check
    limit: float  # loss_spike: the loss the window allowed; nan otherwise

    def describe(self, step: int) -> str:
        if self.reason == LOSS_SPIKE:
            return (f"loss spike at step {step}: {self.value:.4g} is above {self.limit:.4g} "
                    f"(mean + k standard deviations of the recent losses)")
        what = "loss" if self.reason == NONFINITE_LOSS else "gradient norm"
        return f"non-finite {what} at step {step}: {self.value}"


def spike_limit(window: Sequence[float], sigmas: float) -> float:
    """mean + ``sigmas`` population standard deviations of ``window`` (not empty)."""
    mean = sum(window) / len(window)
    var = sum((x - mean) ** 2 for x in window) / len(window)
    return mean + sigmas * math.sqrt(var)


def inspect(loss: float, grad_norm: float, window: Sequence[float], *, sigmas: float,
            window_size: int, check_grads: bool = True) -> Finding | None:
    """What is wrong with a step, checked in this order: its loss is NaN/Inf, its gradient
    norm is (unless a GradScaler already skips such steps: ``check_grads`` False), its loss
    lies above :func:`spike_limit` of a full window (``sigmas`` 0: no spike check)."""
    if not math.isfinite(loss):
        return Finding(NONFINITE_LOSS, loss, math.nan)
    if check_grads and not math.isfinite(grad_norm):
        return Finding(NONFINITE_GRAD, grad_norm, math.nan)
    # Only a full window: a few early losses give a mean and spread that mean nothing.
    if sigmas > 0 and len(window) >= window_size:
        limit = spike_limit(window, sigmas)
        if loss > limit:
            return Finding(LOSS_SPIKE, loss, limit)
    return None


class NumericsGuard:
    """The rolling window of accepted losses. A flagged step's loss never enters it, so one
    spike does not widen the band that the next is judged by."""

    def __init__(self, cfg: NumericsConfig) -> None:
        self.cfg = cfg
        self._window: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float, grad_norm: float, *, check_grads: bool) -> Finding | None:
        finding = inspect(loss, grad_norm, self._window, sigmas=self.cfg.spike_sigmas,
                          window_size=self.cfg.spike_window, check_grads=check_grads)
        if finding is None and math.isfinite(loss):
            self._window.append(loss)
        return finding

    def state_dict(self) -> dict[str, Any]:
        # In the checkpoint: a resume (or a rollback) judges the next steps as the run did.
        return {"window": list(self._window)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._window.clear()
        self._window.extend((state or {}).get("window", []))
