"""What the web layer may ask of the daemon: a protocol and the frozen views it returns.

The web package depends on this module only, never on the job runner, the database models or
trainer internals. The daemon's ``Node`` implements it; web tests may build a small fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class RunView:
    id: int
    name: str
    state: str  # queued | running | completed | failed | stopped
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None  # for failed runs: the exit code's meaning and the last log lines
    summary: dict[str, Any] = field(default_factory=dict)  # step, loss, val_loss, tokens/s, ...


@dataclass(frozen=True, slots=True)
class MetricSample:
    name: str  # as exposed (counters with _total)
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class ExperimentSpec:
    """An A/B experiment as a user submits it. ``overrides``: base-config fields by dotted
    path ({"model.n_layers": 2}); arms: {"name", "compression": {...}, "precision":
    "fp32"|"bf16"|None} ("fp16" too in forked mode), the first is the baseline.

    ``mode``: ``interleaved`` (arms alternate in blocks of ``block_steps`` inside one job) or
    ``forked`` (each arm runs ``steps`` steps as its own job from one starting checkpoint,
    ``repeats`` times per arm in ABBA order; ``checkpoint`` is that starting point, a
    ``step_<8 digits>.pt`` file, or None to make one with a short base job first)."""

    name: str
    arms: tuple[dict[str, Any], ...]
    steps: int  # the budget, in optimizer steps
    block_steps: int = 20
    warmup_steps: int = 3
    loss_margin: float = 0.05
    overrides: dict[str, Any] = field(default_factory=dict)
    mode: str = "interleaved"
    repeats: int = 2  # forked mode: trials per arm
    checkpoint: str | None = None  # forked mode: the starting checkpoint file


@dataclass(frozen=True, slots=True)
class ExperimentInfo:
    id: int
    name: str
    state: str  # queued | running | done | cancelled | failed
    mode: str
    arms: tuple[str, ...]  # baseline first
    run_id: int | None  # the job that runs it (interleaved mode; None in forked mode)
    verdict: dict[str, Any] | None  # arm -> {"kind", "ratio", "low", "high", "reason", ...}
    config_hash: str
    versions: dict[str, str]
    created_at: datetime
    finished_at: datetime | None


class NodeService(Protocol):
    def runs(self) -> list[RunView]:
        """Every run, newest first (blocking: call it from the threadpool)."""
        ...

    def live_snapshot(self) -> dict[str, Any]:
        """The live series held in memory, as sent first on a websocket (see daemon.hub)."""
        ...

    def subscribe(self) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Live messages as they arrive, through a bounded queue that drops the oldest."""
        ...

    def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The Prometheus exposition (body, content type) for a scrape."""
        ...

    def samples(self, prefix: str) -> list[MetricSample]:
        """Current values of the exported series whose name starts with ``prefix``, as a
        scrape would show them (blocking: collectors read hardware; use the threadpool)."""
        ...

    async def submit_experiment(self, spec: ExperimentSpec) -> ExperimentInfo:
        """Validate, record and start an experiment. ``ValueError`` (a ConfigError) names
        each bad field; nothing is recorded then."""
        ...

    def experiments(self) -> list[ExperimentInfo]:
        """Every experiment, newest first (blocking)."""
        ...

    def experiment(self, experiment_id: int) -> ExperimentInfo | None:
        """One experiment with its verdict so far (blocking)."""
        ...

    async def cancel_experiment(self, experiment_id: int) -> bool:
        """Stop its job and mark it cancelled; False if it had already ended."""
        ...

    def check_token(self, token: str | None) -> bool:
        """Whether ``token`` is the daemon's (required for every state-changing request)."""
        ...

    def health(self) -> dict[str, Any]:
        """Readiness: ``{"ok": bool, ...}``."""
        ...
