"""Goodput's one definition (metrics/goodput.py) and the worker's ledger it folds
(trainer/ledger.py): every second of a run in exactly one bucket."""

from __future__ import annotations

import math
import time

import pytest

from traind.contracts.events import LifecycleEvent, NumericsEvent, StepEvent
from traind.metrics.goodput import BADPUT, GoodputFold
from traind.trainer.ledger import KINDS, Ledger


def clock(started: float, *, setup: float = 0.0, restore: float = 0.0, checkpoint: float = 0.0,
          eval: float = 0.0, numerics: float = 0.0, data: float = 0.0, train: float = 0.0
          ) -> dict[str, float]:
    """A worker's snapshot whose kinds add up to its time, as the ledger's do."""
    kinds = {"setup": setup, "restore": restore, "checkpoint": checkpoint, "eval": eval,
             "numerics": numerics, "data": data, "train": train}
    return {"started": started, "time": started + sum(kinds.values()), **kinds}


def step(n: int, c: dict[str, float]) -> StepEvent:
    return StepEvent(rank=0, step=n, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=10,
                     step_seconds=0.1, data_seconds=0.0, forward_seconds=0.0,
                     backward_seconds=0.0, optimizer_seconds=0.0, steps=10, time=c["time"],
                     clock=c)


def life(phase: str, n: int, **detail: object) -> LifecycleEvent:
    return LifecycleEvent(rank=0, phase=phase, step=n, detail=dict(detail))


def adds_up(g) -> None:  # type: ignore[no-untyped-def]
    assert set(g.badput) == set(BADPUT)
    assert g.productive + sum(g.badput.values()) == pytest.approx(g.wall, abs=1e-9)


def test_one_attempt_every_second_in_one_bucket() -> None:
    fold = GoodputFold(launched=100.0)
    fold.observe(life("started", 0))
    fold.observe(step(10, clock(101.0, setup=2.0, data=0.5, train=10.0)))
    fold.observe(life("checkpoint", 10))
    fold.observe(step(20, clock(101.0, setup=2.0, data=1.0, checkpoint=0.4, eval=0.6,
                                numerics=0.2, train=20.0)))
    live = fold.account()  # up to the newest report
    assert live.wall == pytest.approx(101.0 + 24.2 - 100.0)
    assert live.committed == pytest.approx(10.0)  # step 10's checkpoint holds 10 s of training
    end = clock(101.0, setup=2.0, data=1.0, checkpoint=0.9, eval=1.1, numerics=0.2, train=20.0)
    fold.observe(life("finished", 20, clock=end))
    g = fold.account(end=end["time"] + 1.5)
    adds_up(g)
    assert g.productive == pytest.approx(20.0) and g.committed == pytest.approx(20.0)
    assert g.badput["startup"] == pytest.approx(1.0 + 2.0)  # the launcher, then the setup
    assert g.badput["checkpoint_save"] == pytest.approx(0.9)
    assert g.badput["evaluation"] == pytest.approx(1.1)
    assert g.badput["numerics_skip"] == pytest.approx(0.2)
    assert g.badput["data_wait"] == pytest.approx(1.0)
    assert g.badput["shutdown"] == pytest.approx(1.5)
    assert g.badput["progress_lost"] == g.badput["restart"] == 0.0
    assert g.attempts == 1 and g.ratio == pytest.approx(20.0 / g.wall)
    # ETTR takes off start-up and shutdown, not the saves, evaluation or data wait
    assert g.ettr == pytest.approx((g.wall - 3.0 - 1.5) / g.wall)


def test_a_restart_counts_the_steps_redone_as_lost_and_the_relaunch_as_restart() -> None:
    fold = GoodputFold(launched=0.0)
    fold.observe(life("started", 0))
    for n in (10, 20, 30):  # one second of training per step
        fold.observe(step(n, clock(1.0, setup=1.0, train=float(n))))
        if n == 20:
            fold.observe(life("checkpoint", 20))
    # the rank dies after step 30's report; 4 s later torchrun's new processes start
    second = 1.0 + 1.0 + 30.0 + 4.0
    fold.observe(life("started", 20))  # resumed from step 20's checkpoint
    assert fold.account().badput["progress_lost"] == pytest.approx(10.0)  # steps 21-30
    fold.observe(step(30, clock(second, setup=1.5, restore=0.5, train=10.0)))
    fold.observe(step(40, clock(second, setup=1.5, restore=0.5, train=20.0)))
    end = clock(second, setup=1.5, restore=0.5, train=20.0)
    fold.observe(life("finished", 40, clock=end))
    g = fold.account(end=end["time"])
    adds_up(g)
    assert g.attempts == 2
    assert g.badput["restart"] == pytest.approx(4.0)
    assert g.badput["progress_lost"] == pytest.approx(10.0)
    assert g.badput["checkpoint_restore"] == pytest.approx(0.5)
    assert g.badput["startup"] == pytest.approx(1.0 + 1.0 + 1.5)
    assert g.productive == pytest.approx(40.0)  # 40 steps of 1 s, each kept once
    assert g.ettr == pytest.approx((g.wall - 3.5 - 4.0 - 0.5 - 10.0) / g.wall)


def test_a_rollback_between_reports_loses_the_interpolated_training() -> None:
    fold = GoodputFold(launched=0.0)
    fold.observe(life("started", 0))
    fold.observe(step(10, clock(0.0, train=10.0)))
    fold.observe(life("checkpoint", 10))
    fold.observe(step(20, clock(0.0, train=30.0)))  # steps 11-20 took 2 s each
    fold.observe(NumericsEvent(rank=0, step=25, action="rollback", reason="loss_spike",
                               value=9.0, resume_step=15))
    assert fold.account().badput["progress_lost"] == pytest.approx(30.0 - 20.0)
    fold.observe(step(30, clock(0.0, train=60.0)))
    g = fold.account()
    adds_up(g)
    assert g.productive == pytest.approx(50.0)
    assert g.committed == pytest.approx(10.0)  # only step 10's checkpoint holds training


def test_a_run_that_never_reported_was_all_start_up() -> None:
    g = GoodputFold(launched=5.0).account(end=8.0)
    adds_up(g)
    assert g.badput["startup"] == pytest.approx(3.0) and g.productive == 0.0 and g.ratio == 0


def test_the_workers_ledger_partitions_its_life() -> None:
    ledger = Ledger(started=time.time() - 2.0)  # the process began 2 s ago
    before = ledger.snapshot(data_wait=0.0)
    assert before["train"] == 0.0 and before["setup"] == pytest.approx(2.0, abs=0.05)
    with ledger.span("restore"):
        time.sleep(0.02)
    ledger.loop_started()
    with ledger.span("eval"):
        time.sleep(0.03)
    time.sleep(0.05)  # training
    ledger.add("numerics", 0.01)
    snap = ledger.snapshot(data_wait=0.02)
    assert set(snap) == {"started", "time", *KINDS}
    total = sum(snap[k] for k in KINDS)
    assert math.isclose(total, snap["time"] - snap["started"], abs_tol=1e-6)
    assert snap["restore"] >= 0.02 and snap["eval"] >= 0.03 and snap["data"] == 0.02
    assert snap["train"] == pytest.approx(0.05 - 0.01 - 0.02, abs=0.03)
    with pytest.raises(ValueError, match="ledger kind"):
        ledger.add("lunch", 1.0)


def test_the_node_counts_its_runs_productive_time_and_the_time_none_ran() -> None:
    from prometheus_client import CollectorRegistry

    from traind.metrics.daemon import DaemonMetrics
    from traind.metrics.goodput import Goodput, NodeGoodput

    def progress(productive: float) -> Goodput:
        return Goodput(wall=0.0, productive=productive, committed=0.0,
                       badput=dict.fromkeys(BADPUT, 0.0), attempts=1)

    node = NodeGoodput(started=0.0)
    node.run_started(1, at=10.0)  # idle 0-10
    node.run_progress(1, progress(5.0))
    node.run_started(2, at=12.0)  # two at once: each run's productive time counts
    node.run_progress(2, progress(3.0))
    node.run_ended(1, at=20.0)
    node.run_progress(1, progress(99.0))  # an ended run's late figure changes nothing
    node.run_progress(2, progress(8.0))
    node.run_ended(2, at=30.0)  # idle again from 30
    assert node.productive() == 13.0
    assert node.idle(now=40.0) == 10.0 + 10.0
    assert node.ratio(now=40.0) == pytest.approx(13.0 / 40.0)
    reg = CollectorRegistry()
    DaemonMetrics(reg, version="v", torch_version="t", hub_dropped=lambda: 0.0,
                  subscribers=lambda: 0.0, db_pending=lambda: 0.0, node_goodput=node,
                  clock=lambda: 40.0)
    assert reg.get_sample_value("traind_node_idle_seconds") == 20.0
    assert reg.get_sample_value("traind_node_productive_seconds") == 13.0
    assert reg.get_sample_value("traind_node_goodput_ratio") == pytest.approx(13.0 / 40.0)
