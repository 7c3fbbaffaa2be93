"""Straggler attribution (issue 17): arrivals at the gradient collectives on a shared clock,
the skew per step, and the rank named only when chance cannot explain it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from typing import TYPE_CHECKING

import pytest
import torch
from prometheus_client import CollectorRegistry

from traind.contracts.events import Event, LifecycleEvent, StepEvent
from traind.daemon.runs.jobs import Job
from traind.daemon.runs.summary import RunSummary
from traind.metrics.straggler import MIN_STEPS, StragglerFold
from traind.metrics.training import TrainingMetrics
from traind.trainer.clocksync import ClockSync, synchronize
from traind.trainer.config import TrainConfig
from traind.trainer.distributed import DistInfo
from traind.trainer.loop import straggle

if TYPE_CHECKING:
    from pathlib import Path


def feed(fold: StragglerFold, steps: int, lag_of: dict[int, float], seed: int = 0) -> None:
    """Each step every rank arrives at 1000 + step + jitter (+ its planted lag)."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        for rank in rng.sample(range(fold.ranks), fold.ranks):  # reports in any order
            fold.observe(rank, step, 1000.0 + step + rng.uniform(0, 0.004)
                         + lag_of.get(rank, 0.0))


def test_a_rank_late_every_step_is_named_once_chance_cannot_explain_it() -> None:
    fold = StragglerFold(ranks=3)
    feed(fold, MIN_STEPS - 1, {2: 0.05})
    assert fold.verdict().rank is None and fold.verdict().candidate == 2  # too few steps
    feed(fold, 40, {2: 0.05})
    v = fold.verdict()
    assert v.rank == 2 and v.share == 1.0 and v.confidence > 0.999
    assert v.lag == pytest.approx(0.05, abs=0.005)


def test_no_rank_is_named_when_arrivals_are_random() -> None:
    for seed in range(20):
        fold = StragglerFold(ranks=4)
        feed(fold, 200, {}, seed=seed)
        assert fold.verdict().rank is None, seed


def test_a_lag_within_the_clocks_error_names_nobody() -> None:
    fold = StragglerFold(ranks=3, error=0.1)  # clocks that agree to 100 ms only
    feed(fold, 50, {1: 0.05})
    v = fold.verdict()
    assert v.candidate == 1 and v.confidence > 0.999 and v.rank is None


def test_a_step_whose_last_report_is_lost_does_not_linger() -> None:
    fold = StragglerFold(ranks=2)
    for step in range(1, 200):
        assert fold.observe(0, step, 1000.0 + step) is None  # rank 1's reports never come
    assert len(fold._pending) <= 64
    skew = fold.observe(1, 199, 1000.0 + 199 + 0.25)
    assert skew is not None and skew.last == 1 and skew.skew == pytest.approx(0.25)


def test_the_summary_folds_every_ranks_arrivals_and_prometheus_gets_each_verdict() -> None:
    """One fold (the run's summary, as the supervisor keeps it); the metrics are told."""
    reg = CollectorRegistry()
    tm = TrainingMetrics(reg)
    summary = RunSummary(ranks_per_node=3)
    for rank in range(3):
        summary.observe(LifecycleEvent(rank=rank, phase="started", step=0,
                                       detail={"world_size": 3, "clock_error": 0.0005}))
    for step in range(1, 31):
        for rank in range(3):
            changes = summary.observe(StepEvent(
                rank=rank, step=step, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=1,
                step_seconds=0.1, data_seconds=0, forward_seconds=0, backward_seconds=0,
                optimizer_seconds=0,
                arrival=100.0 + step + (0.02 if rank == 1 else 0.001 * rank)))
            assert (changes.skew is not None) == (rank == 2)  # the step's last report
            if changes.skew is not None and changes.straggler is not None:
                tm.straggler(5, changes.skew, changes.straggler)
    get = reg.get_sample_value
    assert get("traind_straggler_rank", {"run": "5"}) == 1
    assert get("traind_straggler_confidence_ratio", {"run": "5"}) > 0.999
    assert get("traind_rank_arrival_skew_seconds_count", {"run": "5"}) == 30
    assert get("traind_rank_arrival_skew_seconds_bucket", {"run": "5", "le": "0.025"}) == 30
    stored = summary.as_dict()["straggler"]
    assert stored["rank"] == 1 and stored["steps"] == 30 and stored["error"] == 0.0005
    assert stored["lag"] == pytest.approx(0.019) and stored["at_step"] == 30  # 0.02 - 0.001


def test_one_rank_needs_no_clock_and_the_fault_knob_reads_rank_and_seconds() -> None:
    one = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                   owns_group=False)
    assert synchronize(one) == ClockSync(0.0, 0.0)
    assert ClockSync(0.25, 0.001).shared(10.0) == 9.75
    assert straggle("1:0.05", 1) == 0.05 and straggle("1:0.05", 0) == 0.0
    assert straggle(None, 0) == 0.0
    with pytest.raises(ValueError, match="TRAIND_DEBUG_SLOW_RANK"):
        straggle("one:fast", 0)


# -- a real 3-rank job (gloo) --------------------------------------------------------------

def _run(tmp: Path, slow: str | None) -> list[Event]:
    cfg = TrainConfig.model_validate({
        "job": {"steps": 40, "batch_size": 4, "threads": 1, "out_dir": str(tmp),
                "eval_every": 10_000, "checkpoint_every": 10_000, "device": "cpu",
                "nproc_per_node": 3},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000}, "telemetry": {"per_layer": False}})
    events: list[Event] = []

    async def go() -> None:
        job = Job(cfg, tmp, events.append,
                  env={"TRAIND_DEBUG_SLOW_RANK": slow} if slow else None)
        await job.start()
        exit_ = await asyncio.wait_for(job.wait(), 240)
        assert exit_.state == "completed", job.log_path.read_text()[-3000:]

    # In a thread of its own: the browser tests earlier in the session leave an event loop
    # running in this one, and asyncio.run refuses to nest (as in tests/web/test_experiments).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, go()).result(300)
    return events


def _judge(events: list[Event]) -> tuple[StragglerFold, int | None]:
    """The fold over the job's events, and the step at which a rank was first named."""
    started = [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "started"]
    fold = StragglerFold(ranks=3, error=max(float(e.detail["clock_error"]) for e in started))
    named_at = None
    for e in events:
        complete = (isinstance(e, StepEvent) and e.arrival > 0
                    and fold.observe(e.rank, e.step, e.arrival) is not None)
        if complete and named_at is None and fold.verdict().rank is not None:
            named_at = e.step
    return fold, named_at


@pytest.mark.slow
def test_a_slowed_rank_of_a_real_job_is_named_and_none_when_none_is_slowed(tmp_path: Path
                                                                          ) -> None:
    fold, named_at = _judge(_run(tmp_path / "slow", "1:0.05"))
    v = fold.verdict()
    print(f"slowed rank 1 by 50 ms a step: named {v.rank} at step {named_at}, confidence "
          f"{v.confidence:.6f}, last in {v.share:.0%} of {v.steps} steps, median lag "
          f"{v.lag * 1e3:.1f} ms, clock error {fold.error * 1e3:.2f} ms")
    assert v.rank == 1 and named_at is not None and named_at <= 15
    assert v.lag == pytest.approx(0.05, rel=0.5)
    fold, named_at = _judge(_run(tmp_path / "even", None))
    v = fold.verdict()
    print(f"no rank slowed: named {v.rank}; the most often last, rank {v.candidate}, in "
          f"{v.share:.0%} of {v.steps} steps (confidence {v.confidence:.3f}), median lag "
          f"{v.lag * 1e3:.2f} ms")
    assert v.steps >= 35 and v.rank is None and named_at is None


def test_the_binomial_tail_is_scipys() -> None:
    from scipy.stats import binom

    from traind.metrics.straggler import WINDOW, binomial_tail

    for n, k, p in [(10, 10, 1 / 3), (40, 25, 1 / 3), (WINDOW, 80, 1 / 4), (WINDOW, 1, 0.5),
                    (30, 0, 0.5), (WINDOW, WINDOW, 1 / 8)]:
        assert binomial_tail(k, n, p) == pytest.approx(binom.sf(k - 1, n, p), rel=1e-9,
                                                       abs=1e-300)
