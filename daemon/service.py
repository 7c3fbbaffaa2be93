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

    def health(self) -> dict[str, Any]:
        """Readiness: ``{"ok": bool, ...}``."""
        ...
