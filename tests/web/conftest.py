"""Web test helpers: a fake node service around a real EventHub, a live uvicorn server, and
Debian's chromium for Playwright.

Tests reach everything through fixtures, not imports: tests/ has no ``__init__.py``, and
fixtures work the same under every pytest import mode.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import uvicorn

from traind.daemon.hub import EventHub
from traind.daemon.service import RunView

# Recent, so the running run's duration in the screenshots looks like a real one.
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=12)


@dataclass
class FakeService:
    """Implements traind.daemon.service.NodeService with canned runs and a real hub."""

    run_views: list[RunView] = field(default_factory=list)
    healthy: bool = True
    hub: EventHub = field(default_factory=EventHub)
    accepts: list[str | None] = field(default_factory=list)

    def runs(self) -> list[RunView]:
        return list(self.run_views)

    def live_snapshot(self) -> dict[str, Any]:
        return self.hub.snapshot()

    def subscribe(self) -> AbstractAsyncContextManager[Any]:
        return self.hub.subscribe()

    def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        self.accepts.append(accept)
        body = b"# HELP traind_up Whether traind is up.\n# TYPE traind_up gauge\ntraind_up 1\n"
        return body, "text/plain; version=0.0.4; charset=utf-8"

    def health(self) -> dict[str, Any]:
        return {"ok": self.healthy, "db": "ok" if self.healthy else "unreachable"}


def sample_runs() -> list[RunView]:
    """Newest first, one per state, with the failed one carrying log lines."""
    return [
        RunView(
            id=3,
            name="gpt-small-bf16",
            state="running",
            created_at=T0,
            started_at=T0 + timedelta(seconds=5),
            finished_at=None,
            exit_code=None,
            error=None,
            summary={"step": 1200, "loss": 3.21, "val_loss": 3.4, "tokens_per_second": 51234.5},
        ),
        RunView(
            id=2,
            name="gpt-small-fp8",
            state="failed",
            created_at=T0 - timedelta(hours=2),
            started_at=T0 - timedelta(hours=2),
            finished_at=T0 - timedelta(hours=1, minutes=58),
            exit_code=1,
            error="exit code 1: error\nTraceback (most recent call last):\nRuntimeError: <boom>",
            summary={"step": 40, "loss": 7.5},
        ),
        RunView(
            id=1,
            name="baseline",
            state="completed",
            created_at=T0 - timedelta(days=1),
            started_at=T0 - timedelta(days=1),
            finished_at=T0 - timedelta(hours=20),
            exit_code=0,
            error=None,
            summary={"step": 5000, "loss": 2.9, "val_loss": 3.0, "tokens_per_second": 48000},
        ),
    ]


def step_message(run: int, step: int) -> dict[str, Any]:
    """A plausible step: loss decaying from ~8, throughput and grad norm with some wobble."""
    wobble = (math.sin(step * 12.9898) * 43758.5453) % 1  # deterministic noise in [0, 1)
    return {
        "type": "step",
        "run": run,
        "step": step,
        "loss": 2.8 + 5.5 / (1 + step / 40) + 0.15 * wobble,
        "lr": 3e-4,
        "grad_norm": 0.6 + 2.5 / (1 + step / 30) + 0.2 * wobble,
        "tokens_per_second": 50000 + 3000 * wobble,
        "step_seconds": 0.08,
        "time": 1.7e9 + step,
    }


def eval_message(run: int, step: int) -> dict[str, Any]:
    return {
        "type": "eval",
        "run": run,
        "step": step,
        "val_loss": 3.0 + 5.5 / (1 + step / 40),
        "time": 1.7e9 + step,
    }


class LiveServer:
    """uvicorn serving an app on a free 127.0.0.1 port, its event loop in a background thread.

    ``loop`` is the server's loop: the hub must be published to from it
    (``asyncio.run_coroutine_threadsafe(coro, server.loop)``).
    """

    def __init__(self, app: Any) -> None:
        # port=0: the OS picks a free port at bind time, so there is no probe-then-bind race.
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> LiveServer:
        self._thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def service() -> FakeService:
    return FakeService(run_views=sample_runs())


@pytest.fixture
def fake_service() -> type[FakeService]:
    """The class, for tests that want a service with other runs or health."""
    return FakeService


@pytest.fixture
def make_step() -> Callable[[int, int], dict[str, Any]]:
    return step_message


@pytest.fixture
def make_eval() -> Callable[[int, int], dict[str, Any]]:
    return eval_message


@pytest.fixture
def live_server() -> type[LiveServer]:
    return LiveServer
