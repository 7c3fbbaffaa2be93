"""Finished runs' series leave /metrics after the retention, and take their state along."""

from __future__ import annotations

import gc
import tracemalloc

from prometheus_client import CollectorRegistry

from traind.contracts.comm import LATENCY_BOUNDS
from traind.contracts.events import (
    ArmEvent,
    CommEvent,
    DataEvent,
    EvalEvent,
    Event,
    LayerEvent,
    LifecycleEvent,
    NumericsEvent,
    PrecisionEvent,
    ProbeEvent,
    SNREvent,
    StepEvent,
)
from traind.metrics.retention import due
from traind.metrics.training import TrainingMetrics

RETENTION = 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_events(world: int = 2, steps: int = 4) -> list[Event]:
    """A short job that touches every run-labelled family."""
    out: list[Event] = []
    for r in range(world):
        out.append(LifecycleEvent(rank=r, phase="started", step=0, detail={
            "world_size": world, "params": 1000, "flops_per_token": 6e3, "peak_flops": 1e12,
            "precision_modes": {"block.0": "fp32", "head": "fp32"}}))
    for s in range(1, steps + 1):
        for r in range(world):
            out.append(StepEvent(
                rank=r, step=s, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=64,
                step_seconds=0.01, data_seconds=0.001, forward_seconds=0.003,
                backward_seconds=0.004, optimizer_seconds=0.002, time=100.0 + 0.02 * s,
                cuda_memory={"allocated_bytes": 1.0, "reserved_bytes": 2.0,
                             "peak_allocated_bytes": 3.0, "alloc_retries": 0, "ooms": 0}))
            out.append(DataEvent(
                rank=r, step=s, cache_hits={"memory": s}, cache_misses={"disk": 1},
                cache_write_errors=0, filtered={"empty": 1}, documents_kept=5, bytes_kept=50,
                batches_served=s, prefetch_capacity=2, prefetch_depth_mean=1.0,
                prefetch_depth_last=1, prefetch_wait_seconds=0.01 * s))
            out.append(CommEvent(
                rank=r, step=s, method="int8", steps=1, buckets=2, raw_bytes=400,
                sent_bytes=100, rel_error=0.01, hook_seconds=0.001, allreduce_seconds=0.002,
                collectives=[{"op": "all_reduce", "size": "4KiB", "calls": 2, "bytes": 200,
                              "seconds": 0.002,
                              "counts": [0, 0, 2] + [0] * (len(LATENCY_BOUNDS) - 2)}],
                ddp={"forward_compute": 0.01, "backward_compute": 0.02,
                     "backward_comm": 0.01, "backward_overlap": 0.005}, world_size=world))
            out.append(SNREvent(rank=r, step=s, window_step=s, groups=["block.0", "head"],
                                snr=[3.0, 4.0], modes=["fp32", "bf16"]))
            out.append(ProbeEvent(rank=r, step=s, op="all_reduce", world_size=world,
                                  sizes=[4096], seconds=[0.001]))
            out.append(ArmEvent(rank=r, step=s, arm="A", block=s, steps=1, tokens=64,
                                seconds=0.01, loss=3.0))
        out.append(LayerEvent(rank=0, step=s, layers=["embed", "head"], grad_norm=[1.0, 2.0],
                              weight_norm=[3.0, 4.0], update_ratio=[0.1, 0.2]))
    for r in range(world):
        out += [EvalEvent(rank=r, step=steps, val_loss=3.1, batches=1),
                PrecisionEvent(rank=r, step=steps, group="head", before="fp32", after="bf16",
                               snr=9.0),
                NumericsEvent(rank=r, step=steps, action="skip_step", reason="loss_spike",
                              value=9.0),
                LifecycleEvent(rank=r, phase="checkpoint", step=steps,
                               detail={"seconds": 0.1}),
                LifecycleEvent(rank=r, phase="finished", step=steps)]
    return out


def samples(registry: CollectorRegistry) -> int:
    return sum(len(f.samples) for f in registry.collect())


def runs_in(registry: CollectorRegistry) -> set[str]:
    return {s.labels["run"] for f in registry.collect() for s in f.samples}


def test_finished_runs_series_leave_after_the_retention() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry, retention_seconds=RETENTION, clock=clock)
    for event in run_events():
        metrics.observe(0, event)  # run 0 stays live throughout
    one_live_run = samples(registry)
    assert one_live_run > 100  # the stream touched the families (sanity)
    for run in range(1, 51):
        for event in run_events():
            metrics.observe(run, event)
        metrics.finished(run)
        clock.now += 1.0
    # Within the retention every finished run is still there, for its final scrapes.
    assert runs_in(registry) == {str(r) for r in range(51)}
    assert samples(registry) == 51 * one_live_run
    clock.now += RETENTION - 50.0  # run 1's deadline, not yet run 2's
    assert runs_in(registry) == {str(r) for r in range(51)} - {"1"}
    clock.now += 50.0
    assert samples(registry) == one_live_run
    assert runs_in(registry) == {"0"}
    assert metrics.series.runs() == 1 and set(metrics._runs) == {"0"}


def test_removal_is_lazy_on_the_next_event_too() -> None:
    clock = Clock()
    metrics = TrainingMetrics(CollectorRegistry(), retention_seconds=RETENTION, clock=clock)
    events = run_events(world=1, steps=1)
    for event in events:
        metrics.observe(1, event)
    metrics.finished(1, at=clock.now - RETENTION)  # ended a retention ago
    assert metrics.series.runs() == 1  # nothing happens by itself
    metrics.observe(2, events[0])
    assert metrics.series.runs() == 1 and set(metrics._runs) == {"2"}


def test_memory_does_not_grow_with_runs() -> None:
    clock = Clock()
    metrics = TrainingMetrics(CollectorRegistry(), retention_seconds=RETENTION, clock=clock)
    events = run_events()  # the same objects each run: only the daemon's side is measured

    def train(runs: range) -> int:
        for run in runs:
            for event in events:
                metrics.observe(run, event)
            metrics.finished(run)
            clock.now += RETENTION + 1.0
            metrics.expire()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        train(range(1, 3))  # first use: caches, interned strings
        after_25 = train(range(3, 26))
        after_50 = train(range(26, 51))
    finally:
        tracemalloc.stop()
    assert after_50 - after_25 < 16 * 1024, (after_25, after_50)


def test_due_lists_the_runs_past_their_deadline() -> None:
    assert due({"1": 10.0, "2": 20.0, "3": 15.0}, 15.0) == ["1", "3"]
    assert due({}, 15.0) == []
