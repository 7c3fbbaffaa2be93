"""Worker events as the daemon passes them on: pure translations, one per destination.

``hub_message``: what the live page gets (None for an event it does not chart); ``row``: what
the database keeps of a run's events (None for the high-rate ones, which live in the summary
and the metrics). Both take only the event and plain values, so each kind is tested directly.
"""

from __future__ import annotations

import math
from typing import Any

from traind.contracts.events import (
    ArmEvent,
    EvalEvent,
    Event,
    LifecycleEvent,
    LinkEvent,
    NumericsEvent,
    PrecisionEvent,
    SNREvent,
    StepEvent,
)
from traind.metrics import throughput


def finite(value: float) -> float | None:
    """A figure for the browser's JSON.parse, which has no NaN or Infinity: None instead."""
    return value if math.isfinite(value) else None


def finite_or_none(value: float | None) -> float | None:
    """``finite`` for a stored figure that may be missing."""
    return None if value is None else finite(value)


def hub_message(run_id: int, event: Event, *, tokens_per_second: float,
                goodput: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The live message for a lead-rank ``event``; ``tokens_per_second`` and ``goodput``
    (``Goodput.as_dict``): the run's figures as its summary holds them after this event."""
    if isinstance(event, StepEvent):
        g = goodput or {}
        return {"type": "step", "run": run_id, "step": event.step, "loss": event.loss,
                "lr": event.lr, "grad_norm": event.grad_norm,
                "tokens_per_second": tokens_per_second,
                "goodput": finite_or_none(g.get("ratio")), "ettr": finite_or_none(g.get("ettr")),
                "step_seconds": event.step_seconds, "time": event.time}
    if isinstance(event, EvalEvent):
        return {"type": "eval", "run": run_id, "step": event.step,
                "val_loss": event.val_loss, "time": event.time}
    if isinstance(event, PrecisionEvent):
        return {"type": "precision", "run": run_id, "step": event.step,
                "group": event.group, "before": event.before,
                "after": event.after, "snr": finite(event.snr)}
    if isinstance(event, SNREvent):
        return {"type": "snr", "run": run_id, "step": event.window_step,
                "groups": event.groups, "snr": [finite(v) for v in event.snr],
                "modes": event.modes}
    return None


def row(event: Event) -> dict[str, Any] | None:
    """The run-event row for a lead-rank ``event`` (kind, step, value, data)."""
    if isinstance(event, EvalEvent):
        return {"kind": "eval", "step": event.step, "value": event.val_loss,
                "data": {"batches": event.batches}}
    if isinstance(event, LifecycleEvent):
        return {"kind": event.phase, "step": event.step, "data": event.detail}
    if isinstance(event, ArmEvent):  # one row per block: the evidence for a verdict
        return {"kind": "arm", "step": event.step,
                "value": finite(throughput.rate(event.tokens, event.seconds)),  # one rank's
                "data": {"arm": event.arm, "block": event.block, "steps": event.steps,
                         "tokens": event.tokens, "seconds": event.seconds,
                         "loss": finite(event.loss), "grad_error": finite(event.grad_error)}}
    if isinstance(event, PrecisionEvent):  # rare, and the evidence for each switch
        return {"kind": "precision", "step": event.step, "value": event.snr,
                "data": {"group": event.group, "before": event.before, "after": event.after}}
    if isinstance(event, NumericsEvent):  # rare: what the numerics policy did, for the run page
        return {"kind": "numerics", "step": event.step, "value": finite(event.value),
                "data": {"action": event.action, "reason": event.reason,
                         "limit": finite(event.limit), "resume_step": event.resume_step,
                         "skipped_batches": event.skipped_batches}}
    if isinstance(event, LinkEvent):  # once a run: the matrix outlives the gauges' retention
        return {"kind": "link", "step": event.step, "value": event.seconds,
                "data": {"placement": event.placement, "order": event.order,
                         "latency": event.latency, "bandwidth": event.bandwidth}}
    return None
