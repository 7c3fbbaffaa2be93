"""The one definition of throughput, and every figure that shows it agreeing."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from traind.contracts.events import LifecycleEvent, StepEvent
from traind.daemon.db.engine import make_engine
from traind.daemon.experiments.lease import TrialTrace
from traind.daemon.promotions import Guard
from traind.daemon.runs.summary import RunSummary
from traind.metrics.throughput import (
    SMOOTHING_SECONDS,
    Throughput,
    Window,
    interval,
    mfu,
    rate,
)
from traind.metrics.training import TrainingMetrics

TOKENS = 512  # per rank per step
WORLD = 2
JOB_RATE = 20_000.0  # the job's tokens per second of wall time in the stream below


def report(rank: int, step: int, steps: int, time: float, step_seconds: float) -> StepEvent:
    return StepEvent(rank=rank, step=step, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=TOKENS,
                     step_seconds=step_seconds, data_seconds=0.0, forward_seconds=0.0,
                     backward_seconds=0.0, optimizer_seconds=0.0, steps=steps, time=time)


def job_stream() -> list[StepEvent | LifecycleEvent]:
    """A 2-rank job at a steady JOB_RATE of wall time, reporting every 1-3 steps, whose step
    timer reads well below the wall time between reports (evaluations, checkpoints and
    telemetry happen between steps) and jitters: the figures of step_seconds disagree."""
    out: list[StepEvent | LifecycleEvent] = [
        LifecycleEvent(rank=r, phase="started", step=0, detail={"world_size": WORLD})
        for r in range(WORLD)]
    per_step = TOKENS * WORLD / JOB_RATE  # wall seconds of one step of the job
    # The first report has no interval before it: it stands for its own step.
    step, now = 1, 1000.0
    out += [report(r, step, 1, now + 0.001 * r, per_step) for r in range(WORLD)]
    for i in range(40):
        steps = 1 + i % 3
        step, now = step + steps, now + steps * per_step
        for r in range(WORLD):
            out.append(report(r, step, steps, now + 0.001 * r,
                              per_step * (0.5 + 0.1 * ((i + r) % 4))))
    return out


def test_every_figure_of_one_event_stream_agrees() -> None:
    """Prometheus, the runs page/DB/live page (RunSummary), a forked trial and the guard's
    samples all show the job's tokens per second of wall time, from one stream."""
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    summary = RunSummary(ranks_per_node=WORLD)
    trace = TrialTrace()
    guard = Guard(make_engine("sqlite://"), lambda _run: None)
    for event in job_stream():
        metrics.observe(1, event)
        summary.observe(event)
        guard.observe(1, event)
        if summary.lead(event.rank):  # the node feeds the trace its lead rank's events
            trace.observe(event)
    figures = {
        "prometheus rank 0": registry.get_sample_value(
            "traind_train_tokens_per_second", {"run": "1", "rank": "0"}),
        "prometheus rank 1": registry.get_sample_value(
            "traind_train_tokens_per_second", {"run": "1", "rank": "1"}),
        "summary (runs page, database, live page)": summary.as_dict()["tokens_per_second"],
        "forked trial": trace.tokens_per_second(),
        "guard's last sample": guard._recent[1][-1].tokens_per_second,
    }
    for name, value in figures.items():
        assert value == pytest.approx(JOB_RATE, rel=1e-9), (name, figures)


@pytest.mark.parametrize(("previous", "event", "expected"), [
    # contiguous: the job's tokens over the wall time since the last report
    ((10, 1, 100.0, 0.1), (13, 3, 101.5, 0.2), (64 * 3 * 4, 1.5)),
    # no previous report: its own step
    (None, (13, 3, 101.5, 0.2), (64 * 4, 0.2)),
    # a gap in the steps (a restart, a rollback): its own step
    ((20, 1, 100.0, 0.1), (13, 3, 101.5, 0.2), (64 * 4, 0.2)),
    # a clock that did not advance: its own step
    ((10, 1, 101.5, 0.1), (13, 3, 101.5, 0.2), (64 * 4, 0.2)),
    # nothing to time at all
    (None, (13, 3, 0.0, 0.0), (64 * 4, 0.0)),
])
def test_interval(previous: tuple[int, int, float, float] | None,
                  event: tuple[int, int, float, float],
                  expected: tuple[float, float]) -> None:
    def ev(step: int, steps: int, time: float, step_seconds: float) -> StepEvent:
        return StepEvent(rank=0, step=step, loss=1.0, lr=0.0, grad_norm=0.0, tokens=64,
                         step_seconds=step_seconds, data_seconds=0, forward_seconds=0,
                         backward_seconds=0, optimizer_seconds=0, steps=steps, time=time)

    prev = ev(*previous) if previous is not None else None
    tokens, seconds = interval(ev(*event), prev, 4)
    assert (tokens, seconds) == pytest.approx(expected)


def test_rate_of_no_time_is_no_figure() -> None:
    assert rate(100, 2) == 50
    assert math.isnan(rate(100, 0))


def _steps(rates_and_seconds: list[tuple[float, float]]) -> list[StepEvent]:
    """One step per report, each taking ``seconds`` of wall time at ``rate`` tokens/s."""
    out, now = [], 0.0
    for i, (tps, seconds) in enumerate(rates_and_seconds):
        now += seconds
        out.append(StepEvent(rank=0, step=i + 1, loss=1.0, lr=0.0, grad_norm=0.0,
                             tokens=round(tps * seconds), step_seconds=seconds,
                             data_seconds=0, forward_seconds=0, backward_seconds=0,
                             optimizer_seconds=0, time=now))
    return out


def test_smoothing_weights_intervals_by_their_wall_time() -> None:
    """A ratio of decayed sums: a long slow interval counts for its length, and what is
    older than a few time constants is forgotten."""
    t = Throughput()
    for e in _steps([(1000.0, 1.0)] * 10 + [(100.0, 10.0)]):
        t.observe(e, 1)
    assert t.last == pytest.approx(100.0)
    keep = math.exp(-10.0 / SMOOTHING_SECONDS)
    fast = sum(1000.0 * math.exp(-k / SMOOTHING_SECONDS) for k in range(10))
    secs = sum(math.exp(-k / SMOOTHING_SECONDS) for k in range(10))
    assert t.smoothed == pytest.approx((fast * keep + 1000.0) / (secs * keep + 10.0))
    for e in _steps([(1000.0, 1.0)] * 11 + [(100.0, 1.0)] * 600)[11:]:
        t.observe(e, 1)
    assert t.smoothed == pytest.approx(100.0, rel=1e-3)


def test_a_window_is_a_ratio_of_totals_after_its_warm_up() -> None:
    w = Window(skip=2)
    assert w.tokens_per_second is None
    w.add(10.0, 1.0)
    w.add(0.0, 0.0)  # untimed: not counted, not even as warm-up
    assert w.tokens_per_second == 10.0  # warm-up only: all there is
    w.add(30.0, 1.0)
    w.add(100.0, 1.0)
    w.add(300.0, 4.0)
    assert w.tokens_per_second == pytest.approx(400.0 / 5.0)


@pytest.mark.parametrize(("tps", "fpt", "peaks", "expected"), [
    (1000.0, 6e9, [1e15], 6e12 / 1e15),  # one device
    (8000.0, 6e9, [1e15] * 8, 6e12 / 1e15),  # eight at the same speed each: the same MFU
    (8000.0, 6e9, [1e15, 5e14], 48e12 / 1.5e15),  # unlike parts: the sum of their peaks
    (1000.0, 6e9, [1e15, None], None),  # a device whose peak is unknown: no figure
    (1000.0, 6e9, [], None),  # no device seen yet
    (1000.0, None, [1e15], None),  # no FLOPs per token
    (0.0, 6e9, [1e15], 0.0),  # not trained yet: 0, measured
    (math.nan, 6e9, [1e15], None),  # no throughput figure
])
def test_mfu_is_the_job_s_model_flops_over_the_sum_of_its_devices_peaks(
        tps: float, fpt: float | None, peaks: list[float | None], expected: float | None) -> None:
    got = mfu(tps, fpt, peaks)
    assert got == (None if expected is None else pytest.approx(expected))
