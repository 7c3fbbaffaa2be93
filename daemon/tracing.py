"""OpenTelemetry traces of runs, built by the daemon from the workers' events.

Workers import no OpenTelemetry: they already send timed events (a step's phase seconds, a
checkpoint's seconds, each with the unix ``time`` at its end), so the daemon rebuilds the spans
afterwards with explicit start and end times. One trace per run:

    run                       submit -> the supervisor sees the exit (ERROR when it failed)
    ├── step                  one in ``metrics.trace_steps_every`` steps of rank 0
    │   └── data, forward, backward, optimizer
    ├── checkpoint            each checkpoint rank 0 wrote
    └── events: started, resumed, eval, finished

The provider is passed in, never the global one, so each test builds its own with an in-memory
exporter. Without an endpoint there is no provider and :func:`run_tracer` hands out
:class:`NullRunTracer`, whose methods do nothing. Every method runs on the event loop, so the
open spans need no lock, and none blocks: the batch processor exports from its own thread.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode

from traind.contracts.events import EvalEvent, Event, LifecycleEvent, StepEvent
from traind.daemon.config import ConfigError
from traind.extras import MissingExtra, require

if TYPE_CHECKING:
    from traind.daemon.config import MetricsConfig
    from traind.trainer.config import TrainConfig

OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
PHASES = ("data", "forward", "backward", "optimizer")  # the order a step runs them in


def build_tracer_provider(cfg: MetricsConfig, *, service_version: str) -> TracerProvider | None:
    """A provider exporting to ``cfg.otlp_endpoint`` over OTLP/HTTP, or None when it is unset.

    The exporter is the optional extra ``traind[otlp]``, imported only here so a node without
    an endpoint never needs it; a node with one and without the package stops at start-up
    with the fix rather than silently exporting nothing. It is a ``ConfigError`` (a
    ``ValueError``) so the caller can report it as it reports any other bad config value."""
    if not cfg.otlp_endpoint:
        return None
    try:
        exporter_module = require(OTLP_MODULE)
    except MissingExtra as exc:
        raise ConfigError.at(("metrics", "otlp_endpoint"), f"is set, but {exc}") from None
    resource = Resource.create({
        "service.name": "traind",
        "service.version": service_version,
        "host.name": socket.gethostname(),
    })
    provider = TracerProvider(resource=resource)
    exporter = exporter_module.OTLPSpanExporter(endpoint=traces_url(cfg.otlp_endpoint))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to. The Python exporter uses an ``endpoint`` argument as is
    (only the environment variable gets ``/v1/traces`` appended), while the config documents
    the collector's base URL (``http://collector:4318``): add the path when there is none."""
    parts = urlsplit(endpoint)
    if parts.path.strip("/"):
        return endpoint
    return urlunsplit(parts._replace(path="/v1/traces"))


def run_attributes(cfg: TrainConfig) -> dict[str, Any]:
    """What the run span says about a run before its workers start (pure: from the config)."""
    return {
        "traind.run.name": cfg.job.name,
        "traind.world_size": cfg.job.nproc_per_node * cfg.job.nnodes,
        "traind.strategy": cfg.parallel.strategy,
        "traind.precision": cfg.precision.mode,
        "traind.compression.method": cfg.compression.method,
    }


def seconds_to_ns(seconds: float) -> int:
    return round(seconds * 1e9)


class NullRunTracer:
    """The tracer of a node without an endpoint: the same calls, and nothing happens."""

    def start_run(self, run_id: int, cfg: TrainConfig) -> None:
        """Open the run's span (at submit, before its workers start)."""

    def observe(self, run_id: int, event: Event) -> None:
        """Turn one worker event into spans or span events."""

    def end_run(self, run_id: int, *, state: str, exit_code: int | None = None,
                error: str | None = None) -> None:
        """Close the run's span once the supervisor has seen the exit."""

    def close(self) -> None:
        """End the spans of runs still open (daemon shutdown)."""


def run_tracer(provider: TracerProvider | None, *, steps_every: int) -> NullRunTracer:
    """The node's tracer: a real one when there is a provider, else the null one."""
    if provider is None:
        return NullRunTracer()
    return RunTracer(provider, steps_every=steps_every)


class RunTracer(NullRunTracer):
    def __init__(self, provider: TracerProvider, *, steps_every: int) -> None:
        if steps_every <= 0:
            raise ValueError(f"metrics.trace_steps_every must be > 0 (got {steps_every})")
        self.steps_every = steps_every
        self._tracer = provider.get_tracer("traind.daemon")
        self._runs: dict[int, Span] = {}

    def start_run(self, run_id: int, cfg: TrainConfig) -> None:
        # A new root: runs are independent traces, not children of whatever the loop ran.
        self._runs[run_id] = self._tracer.start_span(
            "run", context=trace.set_span_in_context(trace.INVALID_SPAN),
            attributes={"traind.run.id": run_id, **run_attributes(cfg)})

    def observe(self, run_id: int, event: Event) -> None:
        # Every rank reports started/eval/finished, and the ranks' steps overlap: rank 0
        # speaks for the run, as it does on the dashboard.
        run = self._runs.get(run_id)
        if run is None or event.rank != 0:
            return
        end_ns = seconds_to_ns(event.time or time.time())
        if isinstance(event, StepEvent):
            if event.step % self.steps_every == 0:
                self._step(run, event, end_ns)
        elif isinstance(event, EvalEvent):
            run.add_event("eval", {"traind.step": event.step, "traind.val_loss": event.val_loss,
                                   "traind.eval.batches": event.batches}, timestamp=end_ns)
        elif isinstance(event, LifecycleEvent):
            self._lifecycle(run, event, end_ns)

    def end_run(self, run_id: int, *, state: str, exit_code: int | None = None,
                error: str | None = None) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        run.set_attribute("traind.run.state", state)
        if exit_code is not None:
            run.set_attribute("traind.run.exit_code", exit_code)
        # A stop the daemon asked for is not an error; only a failed exit is.
        if state == "failed":
            run.set_status(Status(StatusCode.ERROR, error or "run failed"))
        else:
            run.set_status(Status(StatusCode.OK))
        run.end()

    def close(self) -> None:
        # The node waits for its supervisors before this, so a span still open here is a run
        # whose exit it never saw: say so rather than report a success nobody observed.
        for run in self._runs.values():
            run.set_attribute("traind.run.state", "unknown")
            run.set_status(Status(StatusCode.ERROR,
                                  "daemon shut down before the run's exit was seen"))
            run.end()
        self._runs.clear()

    # -- building spans from events -----------------------------------------------------------

    def _step(self, run: Span, event: StepEvent, end_ns: int) -> None:
        """A step span with its phases as children. The worker measures each phase's
        duration, not when it began, so the children are reconstructed: exact durations laid
        back to back from the step's start, in the order the loop runs them. With gradient
        accumulation a phase's seconds are the sum over micro-batches, which really interleave.
        """
        phases = [seconds_to_ns(s) for s in (event.data_seconds, event.forward_seconds,
                                             event.backward_seconds, event.optimizer_seconds)]
        # The phases sum to the step on both timers, but rounding (or a worker's odd numbers)
        # must not push a child outside its parent: the step then starts that much earlier.
        start_ns = end_ns - max(seconds_to_ns(event.step_seconds), sum(phases))
        span = self._tracer.start_span(
            "step", context=trace.set_span_in_context(run), start_time=start_ns,
            attributes={"traind.step": event.step, "traind.loss": event.loss,
                        "traind.tokens": event.tokens, "traind.grad_norm": event.grad_norm,
                        "traind.lr": event.lr, "traind.phases.reconstructed": True})
        parent = trace.set_span_in_context(span)
        at = start_ns  # integer ns, so each phase starts exactly where the previous ended
        for name, ns in zip(PHASES, phases, strict=True):
            self._tracer.start_span(name, context=parent, start_time=at).end(end_time=at + ns)
            at += ns
        span.end(end_time=end_ns)

    def _lifecycle(self, run: Span, event: LifecycleEvent, end_ns: int) -> None:
        detail = event.detail
        if event.phase == "checkpoint":
            # The event is sent once the checkpoint is written; its seconds say how long.
            start_ns = end_ns - seconds_to_ns(float(detail.get("seconds", 0.0)))
            attributes: dict[str, Any] = {"traind.step": event.step}
            if "path" in detail:
                attributes["traind.checkpoint.path"] = str(detail["path"])
            if "sharded" in detail:
                attributes["traind.checkpoint.sharded"] = bool(detail["sharded"])
            self._tracer.start_span(
                "checkpoint", context=trace.set_span_in_context(run), start_time=start_ns,
                attributes=attributes).end(end_time=end_ns)
        elif event.phase == "started":
            # The workers know the world they actually joined; the config only asked for it.
            for key in ("world_size", "strategy", "precision", "device", "params"):
                value = detail.get(key)
                if isinstance(value, str | int | float | bool):
                    run.set_attribute(f"traind.{key}", value)
            run.add_event("started", {"traind.step": event.step}, timestamp=end_ns)
        elif event.phase == "resumed":
            attributes = {"traind.step": event.step}
            if "path" in detail:
                attributes["traind.checkpoint.path"] = str(detail["path"])
            run.add_event("resumed", attributes, timestamp=end_ns)
        elif event.phase == "finished":
            run.add_event("finished", {"traind.step": event.step,
                                       "traind.stopped": bool(detail.get("stopped", False))},
                          timestamp=end_ns)
