"""An interleaved experiment names its run, keeps its verdict on its row, and is never left
stranded by the daemon that ran it: a restart queues again the experiments a SIGKILLed daemon
left running with nothing to resume from (their resumption from a checkpoint, with real
kills: tests/e2e/test_preemption.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.daemon.test_node import _node
from traind.daemon.db import crud, queue
from traind.daemon.db.engine import make_engine
from traind.daemon.db.migrate import upgrade
from traind.daemon.experiments.interleaved import _Blocks
from traind.daemon.experiments.specs import LEASE_SECONDS

if TYPE_CHECKING:
    from pathlib import Path

    from sqlalchemy import Engine

ARMS = [{"name": "fp32"}, {"name": "bf16"}]


def _experiment(engine: Engine, run_id: int, *, mode: str = "interleaved") -> int:
    """An experiment whose job ``run_id`` holds its trials, as a daemon leaves it running."""
    exp = queue.create_experiment(engine, name="e", mode=mode, base_config={}, arms=ARMS,
                                  budget={"steps": 100}, traind_version="t", torch_version="t",
                                  device="cpu")
    for _ in ARMS:
        queue.claim(engine, owner=f"run:{run_id}", lease_seconds=LEASE_SECONDS,
                    experiment_id=exp)
    return exp


def _running_run(engine: Engine, node: str) -> int:
    run = crud.create_run(engine, name="r", config={}, kind="experiment", node=node)
    crud.mark_running(engine, run_id=run)
    return run


def test_a_killed_daemons_experiment_with_no_checkpoint_is_queued_again_at_the_next_start(
        tmp_path: Path) -> None:
    node = _node(tmp_path)
    here = node.supervisor.node_name
    mine = _running_run(node.engine, here)  # no folder, no checkpoint: nothing to resume
    exp = _experiment(node.engine, mine)
    queue.link_run(node.engine, experiment_id=exp, run_id=mine)
    theirs = _running_run(node.engine, "another-node")  # a shared database's other daemon
    other = _experiment(node.engine, theirs)
    queue.link_run(node.engine, experiment_id=other, run_id=theirs)
    assert node.service.experiment(exp).state == "running"
    # SIGKILL: nothing saw the run end. The next daemon on this node starts.
    again = _node(tmp_path)
    found = again.service.experiment(exp)
    assert found is not None and found.state == "queued" and found.run_id is None
    assert not found.verdict  # the lost run's verdict so far is no verdict
    assert crud.get_run(again.engine, run_id=mine).state == "stopped"
    trials = queue.list_trials(again.engine, experiment_id=exp)
    assert {t.state for t in trials} == {"waiting"}  # claimable by its next run
    assert again.service.experiment(other).state == "running"  # not this node's to touch
    assert again.interleaved.requeue_stranded(here) == []  # and once is enough


def test_the_live_verdict_is_on_the_experiments_row_and_never_overwrites_the_last(
        tmp_path: Path) -> None:
    node = _node(tmp_path)
    run = _running_run(node.engine, node.supervisor.node_name)
    exp = _experiment(node.engine, run)
    queue.link_run(node.engine, experiment_id=exp, run_id=run)
    runner = node.interleaved
    runner._experiments[run] = exp
    so_far = {"bf16": {"kind": "running", "ratio": 1.2}}
    runner._set_verdict(run, _Blocks(["fp32", "bf16"], 0.05, 400), so_far)
    assert node.service.experiment(exp).verdict is None  # not one write per block: at the flush
    node.flusher.flush()
    assert node.service.experiment(exp).verdict == so_far
    final = {"bf16": {"kind": "better", "ratio": 1.3}}
    queue.finish_experiment(node.engine, experiment_id=exp, verdict=final)
    assert not queue.set_live_verdict(node.engine, experiment_id=exp, verdict=so_far)
    assert node.service.experiment(exp).verdict == final


def test_the_migration_links_experiments_to_the_runs_that_held_their_trials(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0004")  # the schema before experiments.run_id
    engine = make_engine(url)
    run = crud.create_run(engine, name="r", config={})
    linked = _experiment(engine, run)
    forked = queue.create_experiment(engine, name="f", mode="forked", base_config={}, arms=ARMS,
                                     budget={"steps": 10}, traind_version="t",
                                     torch_version="t", device="cpu")
    queue.claim(engine, owner="node-a:123", lease_seconds=60, experiment_id=forked)
    upgrade(url)
    got = queue.get_experiment(engine, experiment_id=linked)
    assert got is not None and got.run_id == run
    assert queue.get_experiment(engine, experiment_id=forked).run_id is None  # type: ignore[union-attr]
