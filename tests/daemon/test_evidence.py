"""What an experiment's page shows beside its verdict: its measurements, each arm's means and
its progress (daemon/experiments/evidence.py), from hand-checkable records."""

from __future__ import annotations

import math

import pytest

from traind.daemon.db.queue import TrialView
from traind.daemon.experiments.evidence import arm_means, blocks_of, progress, trials_of
from traind.daemon.service import Measurement


def _arm_row(arm: str, block: int, tps: float | None, loss: float = 2.0,
             step: int = 0) -> dict:
    return {"kind": "arm", "step": step, "value": tps,
            "data": {"arm": arm, "block": block, "loss": loss}}


def test_blocks_keep_the_newest_figures_of_a_block_run_twice() -> None:
    rows = [_arm_row("A", 0, 100.0, step=20), _arm_row("B", 1, 120.0, step=40),
            _arm_row("B", 1, 125.0, step=40),  # resumed before block 1 ended: run again
            _arm_row("A", 2, None, step=60),  # no timed step: no throughput
            {"kind": "arm", "step": 1, "value": 1.0, "data": {}}]  # not a block: skipped
    ms = blocks_of(rows)
    assert [(m.arm, m.index, m.tokens_per_second) for m in ms] == [
        ("A", 0, 100.0), ("B", 1, 125.0), ("A", 2, None)]


def test_means_are_geometric_for_throughput_as_the_ratio_is() -> None:
    ms = [Measurement("A", 0, 20, 100.0, 2.0), Measurement("B", 1, 40, 200.0, 2.2),
          Measurement("B", 2, 60, 50.0, 2.4), Measurement("A", 3, 80, 400.0, 1.8),
          Measurement("A", 4, 100, None, None)]
    a, b = arm_means(["A", "B"], ms)
    assert a.n == 2 and a.tokens_per_second == pytest.approx(200.0)  # sqrt(100 * 400)
    assert b.n == 2 and b.tokens_per_second == pytest.approx(100.0)
    assert a.loss == pytest.approx(1.9) and b.loss == pytest.approx(2.3)
    (c,) = arm_means(["C"], ms)
    assert c.n == 0 and c.tokens_per_second is None and c.loss is None


def test_interleaved_progress_counts_complete_rounds_of_the_budget() -> None:
    ms = [Measurement(arm, i, 20 * (i + 1), 100.0, 2.0)
          for i, arm in enumerate(["A", "B", "B", "A", "A"])]  # rounds 0, 1 whole; 2 half
    p = progress(mode="interleaved", arms=["A", "B"], budget={"steps": 400, "block_steps": 20},
                 measurements=ms, verdict=None)
    assert (p.done, p.of, p.unit, p.detail) == (2, 10, "pairs", "step 100 of 400")
    # The verdict's own count wins when it is larger (blocks it read that were not stored).
    p = progress(mode="interleaved", arms=["A", "B"], budget={"steps": 400, "block_steps": 20},
                 measurements=ms, verdict={"B": {"kind": "running", "pairs": 3}})
    assert p.done == 3
    p = progress(mode="interleaved", arms=["A", "B"], budget={}, measurements=[], verdict=None)
    assert (p.done, p.of, p.detail) == (0, None, "")


def _trial(arm: str, repeat: int, state: str, tps: float | None = None,
           run: int | None = None) -> TrialView:
    result = {"tokens_per_second": tps, "val_loss": 2.5, "run_id": run} if tps else None
    return TrialView(id=repeat * 2 + (arm == "B"), experiment_id=1, arm_id=1, arm_name=arm,
                     repeat=repeat, state=state, attempt=1, priority=0, lease_owner=None,
                     result=result, error=None)


def test_forked_progress_and_means_come_from_the_trials() -> None:
    ms = trials_of([_trial("A", 0, "done", 100.0, 7), _trial("B", 0, "done", 121.0, 8),
                    _trial("B", 1, "failed"), _trial("A", 1, "running"),
                    _trial("A", 2, "waiting"), _trial("B", 2, "waiting")])
    assert [(m.arm, m.index, m.state, m.run_id) for m in ms][:2] == [
        ("A", 0, "done", 7), ("B", 0, "done", 8)]
    p = progress(mode="forked", arms=["A", "B"], budget={}, measurements=ms, verdict=None)
    assert (p.done, p.of, p.unit, p.detail) == (3, 6, "trials", "1 failed")
    a, b = arm_means(["A", "B"], ms)
    assert (a.n, b.n) == (1, 1)
    assert b.tokens_per_second / a.tokens_per_second == pytest.approx(1.21)
    assert math.isclose(a.loss, 2.5)
