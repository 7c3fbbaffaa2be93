"""Run traces rebuilt from synthetic worker events, read back from an in-memory exporter."""

from __future__ import annotations

import itertools
import sys
import types
from typing import TYPE_CHECKING

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from traind.contracts.events import EvalEvent, Event, LifecycleEvent, StepEvent
from traind.daemon.config import MetricsConfig
from traind.daemon.tracing import (
    OTLP_MODULE,
    PHASES,
    NullRunTracer,
    RunTracer,
    build_tracer_provider,
    run_tracer,
    traces_url,
)
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

T0 = 1_700_000_000.0  # unix seconds: large, so float rounding at this magnitude is exercised
CFG = TrainConfig.model_validate({
    "job": {"name": "tiny", "nproc_per_node": 2},
    "parallel": {"strategy": "zero1"},
    "precision": {"mode": "bf16"},
    "compression": {"method": "int8"},
})


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> RunTracer:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RunTracer(provider, steps_every=100)


def step(n: int, *, rank: int = 0, step_seconds: float | None = None) -> StepEvent:
    data, fwd, bwd, opt = 0.003 + n * 1e-6, 0.021, 0.042 + n * 1e-7, 0.0077
    return StepEvent(
        rank=rank, step=n, loss=3.0 - n / 1000, lr=1e-3, grad_norm=0.5, tokens=4096,
        step_seconds=data + fwd + bwd + opt if step_seconds is None else step_seconds,
        data_seconds=data, forward_seconds=fwd, backward_seconds=bwd, optimizer_seconds=opt,
        time=T0 + n * 0.1)


def run_events() -> list[Event]:
    events: list[Event] = [LifecycleEvent(rank=0, phase="started", step=0, time=T0, detail={
        "world_size": 2, "strategy": "zero1", "precision": "bf16", "device": "cpu"})]
    for n in range(1, 251):
        events += [step(n), step(n, rank=1)]  # rank 1's steps must not be traced
        if n == 150:
            events.append(EvalEvent(rank=0, step=150, val_loss=2.5, batches=4,
                                    time=T0 + 15.05))
        if n == 200:
            events.append(LifecycleEvent(rank=0, phase="checkpoint", step=200, time=T0 + 20.5,
                                         detail={"path": "/runs/1/step_200.pt",
                                                 "seconds": 0.375, "sharded": False}))
    events.append(LifecycleEvent(rank=0, phase="finished", step=250, time=T0 + 25.2))
    return events


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def test_a_completed_run(tracer: RunTracer, exporter: InMemorySpanExporter) -> None:
    tracer.start_run(1, CFG)
    for event in run_events():
        tracer.observe(1, event)
    tracer.end_run(1, state="completed", exit_code=0)
    spans = exporter.get_finished_spans()

    [run] = named(spans, "run")
    assert run.parent is None
    assert run.status.status_code is StatusCode.OK
    assert dict(run.attributes or {}) == {
        "traind.run.id": 1, "traind.run.name": "tiny", "traind.world_size": 2,
        "traind.strategy": "zero1", "traind.precision": "bf16",
        "traind.compression.method": "int8", "traind.device": "cpu",
        "traind.run.state": "completed", "traind.run.exit_code": 0}
    assert run.context is not None
    trace_id, run_span_id = run.context.trace_id, run.context.span_id
    assert all(s.context is not None and s.context.trace_id == trace_id for s in spans)

    steps = named(spans, "step")
    assert [s.attributes["traind.step"] for s in steps if s.attributes] == [100, 200]
    for span in steps:
        assert span.parent is not None and span.parent.span_id == run_span_id
        assert span.attributes is not None and span.context is not None
        n = span.attributes["traind.step"]
        assert isinstance(n, int)
        event = step(n)
        assert span.attributes["traind.loss"] == event.loss
        assert span.attributes["traind.tokens"] == 4096
        assert span.attributes["traind.grad_norm"] == 0.5
        assert span.start_time is not None and span.end_time is not None
        assert span.end_time == ns(event.time)
        assert abs((span.end_time - span.start_time) / 1e9 - event.step_seconds) < 1e-6
        children = sorted((s for s in spans if s.parent is not None
                           and s.parent.span_id == span.context.span_id),
                          key=lambda s: s.start_time or 0)
        assert [c.name for c in children] == list(PHASES)
        seconds = [event.data_seconds, event.forward_seconds, event.backward_seconds,
                   event.optimizer_seconds]
        for child, expected in zip(children, seconds, strict=True):
            assert child.start_time is not None and child.end_time is not None
            assert abs((child.end_time - child.start_time) / 1e9 - expected) < 1e-6
        assert children[0].start_time == span.start_time  # laid from the step's start...
        for before, after in itertools.pairwise(children):
            assert before.end_time == after.start_time  # ...back to back...
        assert (children[-1].end_time or 0) <= span.end_time  # ...and inside the step

    [checkpoint] = named(spans, "checkpoint")
    assert checkpoint.parent is not None and checkpoint.parent.span_id == run_span_id
    assert checkpoint.end_time == ns(T0 + 20.5)
    assert checkpoint.start_time is not None and checkpoint.end_time is not None
    assert abs((checkpoint.end_time - checkpoint.start_time) / 1e9 - 0.375) < 1e-6
    assert dict(checkpoint.attributes or {}) == {
        "traind.step": 200, "traind.checkpoint.path": "/runs/1/step_200.pt",
        "traind.checkpoint.sharded": False}

    assert [e.name for e in run.events] == ["started", "eval", "finished"]
    [eval_] = [e for e in run.events if e.name == "eval"]
    assert eval_.timestamp == ns(T0 + 15.05)
    assert eval_.attributes is not None
    assert eval_.attributes["traind.step"] == 150
    assert eval_.attributes["traind.val_loss"] == 2.5
    assert len(spans) == 1 + 2 * (1 + len(PHASES)) + 1  # nothing else, nothing from rank 1


def test_a_failed_run_is_an_error_with_the_exit_description(
        tracer: RunTracer, exporter: InMemorySpanExporter) -> None:
    tracer.start_run(7, CFG)
    tracer.observe(7, step(100))
    description = "worker exit code 1\n--- last log lines ---\nRuntimeError: boom"
    tracer.end_run(7, state="failed", exit_code=1, error=description)
    [run] = named(exporter.get_finished_spans(), "run")
    assert run.status.status_code is StatusCode.ERROR
    assert run.status.description == description
    assert run.attributes is not None and run.attributes["traind.run.state"] == "failed"


def test_a_stopped_run_is_not_an_error(tracer: RunTracer,
                                       exporter: InMemorySpanExporter) -> None:
    tracer.start_run(1, CFG)
    tracer.end_run(1, state="stopped", exit_code=-15)
    [run] = exporter.get_finished_spans()
    assert run.status.status_code is StatusCode.OK


def test_resumed_is_a_span_event(tracer: RunTracer, exporter: InMemorySpanExporter) -> None:
    tracer.start_run(1, CFG)
    tracer.observe(1, LifecycleEvent(rank=0, phase="resumed", step=200, time=T0,
                                     detail={"step": 200, "path": "/runs/1/step_200.pt"}))
    tracer.end_run(1, state="completed")
    [run] = exporter.get_finished_spans()
    [resumed] = run.events
    assert resumed.name == "resumed" and resumed.timestamp == ns(T0)
    assert dict(resumed.attributes or {}) == {"traind.step": 200,
                                              "traind.checkpoint.path": "/runs/1/step_200.pt"}


def test_phases_longer_than_the_step_stay_inside_it(
        tracer: RunTracer, exporter: InMemorySpanExporter) -> None:
    tracer.start_run(1, CFG)
    event = step(100, step_seconds=0.05)  # phases sum to ~0.074 s
    tracer.observe(1, event)
    tracer.end_run(1, state="completed")
    spans = exporter.get_finished_spans()
    [span] = named(spans, "step")
    phases = [s for s in spans if s.name in PHASES]
    assert span.start_time is not None and span.end_time == ns(event.time)
    assert min(s.start_time or 0 for s in phases) == span.start_time
    assert max(s.end_time or 0 for s in phases) == span.end_time


def test_shutdown_ends_open_runs_and_later_calls_are_ignored(
        tracer: RunTracer, exporter: InMemorySpanExporter) -> None:
    tracer.start_run(1, CFG)
    tracer.start_run(2, CFG)
    tracer.end_run(2, state="completed")
    tracer.close()
    runs = {s.attributes["traind.run.id"]: s for s in exporter.get_finished_spans()
            if s.attributes}
    assert runs[1].status.status_code is StatusCode.ERROR
    assert "shut down" in (runs[1].status.description or "")
    assert runs[2].status.status_code is StatusCode.OK
    tracer.observe(1, step(100))  # events and exits after the span ended: nothing, no error
    tracer.end_run(1, state="completed")
    tracer.observe(99, step(100))  # a run that was never started
    assert len(exporter.get_finished_spans()) == 2


def test_the_null_tracer_takes_the_same_calls() -> None:
    null = run_tracer(None, steps_every=100)
    assert type(null) is NullRunTracer
    null.start_run(1, CFG)
    for event in run_events():
        null.observe(1, event)
    null.end_run(1, state="failed", exit_code=1, error="boom")
    null.close()


def test_run_tracer_is_real_with_a_provider() -> None:
    assert isinstance(run_tracer(TracerProvider(), steps_every=10), RunTracer)
    with pytest.raises(ValueError, match="trace_steps_every"):
        RunTracer(TracerProvider(), steps_every=0)


def test_no_endpoint_no_provider() -> None:
    assert build_tracer_provider(MetricsConfig(), service_version="1.0") is None


def test_an_endpoint_without_the_exporter_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, OTLP_MODULE, None)  # import fails, installed or not
    with pytest.raises(ValueError, match=r"metrics\.otlp_endpoint.*pip install 'traind\[otlp\]'"):
        build_tracer_provider(MetricsConfig(otlp_endpoint="http://collector:4318"),
                              service_version="1.0")


class _FakeOTLPExporter(SpanExporter):
    endpoints: list[str] = []  # what the factory passed; each test patches in a fresh list

    def __init__(self, endpoint: str) -> None:
        self.endpoints.append(endpoint)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def test_an_endpoint_with_the_exporter_builds_a_provider(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType(OTLP_MODULE)
    module.OTLPSpanExporter = _FakeOTLPExporter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, OTLP_MODULE, module)
    monkeypatch.setattr(_FakeOTLPExporter, "endpoints", [])
    provider = build_tracer_provider(MetricsConfig(otlp_endpoint="http://collector:4318"),
                                     service_version="1.2.3")
    assert provider is not None
    try:
        attributes = provider.resource.attributes
        assert attributes["service.name"] == "traind"
        assert attributes["service.version"] == "1.2.3"
        assert attributes["host.name"]
        assert _FakeOTLPExporter.endpoints == ["http://collector:4318/v1/traces"]
    finally:
        provider.shutdown()


@pytest.mark.parametrize(("endpoint", "url"), [
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example.com/v1/traces", "https://otel.example.com/v1/traces"),
    ("https://gw.example.com/tenant/v1/traces", "https://gw.example.com/tenant/v1/traces"),
])
def test_traces_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url
