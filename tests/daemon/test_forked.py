"""Forked A/B experiments on a node: each arm a real torchrun job from one checkpoint."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

import pytest

from traind.daemon.config import load_settings
from traind.daemon.db import crud, queue
from traind.daemon.experiments.forked import judge
from traind.daemon.experiments.stats import KINDS
from traind.daemon.node import Node
from traind.daemon.service import ExperimentSpec

if TYPE_CHECKING:
    from pathlib import Path

TINY = ["job.eval_every=10", "job.eval_batches=1", "job.checkpoint_every=1000",
        "job.threads=1", "job.batch_size=4", "model.seq_len=32", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "data.max_bytes=300000",
        "daemon.default_job=false"]


def _node(tmp_path: Path, *extra: str) -> Node:
    node = Node(load_settings(env={}, overrides=[*TINY, f"daemon.var_dir={tmp_path}", *extra]))
    node.migrate()
    return node


def _spec(**kw: Any) -> ExperimentSpec:
    base: dict[str, Any] = dict(
        name="fork", mode="forked", steps=10, repeats=2, block_steps=10,
        arms=({"name": "fp32", "precision": "fp32"}, {"name": "bf16", "precision": "bf16"}))
    return ExperimentSpec(**{**base, **kw})


async def _settle(node: Node, exp_id: int) -> None:
    await asyncio.wait_for(node.forked.wait(exp_id), timeout=180)
    if node.supervisor.tasks or node.interleaved.tasks:  # the last job's supervision
        await asyncio.wait(node.supervisor.tasks | node.interleaved.tasks, timeout=60)


@pytest.mark.slow
def test_arms_run_abba_from_one_checkpoint_and_get_a_verdict(tmp_path: Path) -> None:
    node = _node(tmp_path)

    async def main() -> int:
        exp = await node.service.submit_experiment(_spec())
        assert exp.mode == "forked" and exp.run_id is None and exp.arms == ("fp32", "bf16")
        await _settle(node, exp.id)
        return exp.id

    exp_id = asyncio.run(main())
    assert node.supervisor.jobs == {}
    found = node.service.experiment(exp_id)
    assert found is not None and found.state == "done", found
    trials = queue.list_trials(node.engine, experiment_id=exp_id)
    assert [t.arm_name for t in trials] == ["fp32", "bf16", "bf16", "fp32"]
    assert [t.state for t in trials] == ["done"] * 4, [t.error for t in trials]
    results = [t.result or {} for t in trials]
    runs = [r["run_id"] for r in results]
    assert runs == sorted(runs)  # launched in queue order: arms interleaved in time
    base_run = runs[0] - 1  # the base job that made the starting checkpoint
    checkpoint = tmp_path / "experiments" / str(exp_id) / "base" / "step_00000010.pt"
    assert crud.get_run(node.engine, run_id=base_run).state == "completed"  # type: ignore[union-attr]
    for t, r in zip(trials, results, strict=True):
        assert r["tokens_per_second"] > 0 and math.isfinite(r["loss"]), r
        assert r["val_loss"] > 0 and r["resumed_from"] == 10
        assert r["checkpoint"] == str(checkpoint)
        resumed = crud.run_events(node.engine, run_id=r["run_id"], kind="resumed")
        assert [e["step"] for e in resumed] == [10], resumed
        out = tmp_path / "experiments" / str(exp_id) / f"trial-{t.id}-{t.attempt}"
        assert (out / "step_00000010.pt").is_file() and (out / "step_00000020.pt").is_file()
    # The arms of a repeat share its data order; each repeat has its own, so the two fp32
    # trials (same weights, optimizer and RNG) train on other batches and end apart.
    orders = [crud.run_config(node.engine, run_id=r["run_id"])["data"]["order"]  # type: ignore[index]
              for r in results]
    assert orders == [t.repeat + 1 for t in trials] == [1, 1, 2, 2]
    assert results[0]["val_loss"] != pytest.approx(results[3]["val_loss"], rel=1e-5)
    verdict = found.verdict["bf16"]  # type: ignore[index]
    assert verdict["kind"] in KINDS and verdict["pairs"] == 2, verdict
    assert verdict["reason"] and verdict["ratio"] > 0
    assert set(verdict) >= {"kind", "pairs", "ratio", "low", "high", "p_value", "reason",
                            "quality"}


@pytest.mark.slow
def test_cancel_stops_the_running_trial(tmp_path: Path) -> None:
    node = _node(tmp_path)

    async def main() -> int:
        exp = await node.service.submit_experiment(_spec(steps=100_000))
        while not (
            any(t.state == "running"
                for t in queue.list_trials(node.engine, experiment_id=exp.id))
            and node.supervisor.jobs
            and all(node.supervisor.summaries[r].step >= 11 for r in node.supervisor.jobs)
        ):
            await asyncio.sleep(0.1)
        trial_run = next(iter(node.supervisor.jobs))
        assert await node.service.cancel_experiment(exp.id)
        await _settle(node, exp.id)
        assert not await node.service.cancel_experiment(exp.id)  # already ended
        run = crud.get_run(node.engine, run_id=trial_run)
        assert run is not None and run.state == "stopped", run
        return exp.id

    exp_id = asyncio.run(main())
    assert node.supervisor.jobs == {}
    found = node.service.experiment(exp_id)
    assert found is not None and found.state == "cancelled" and found.verdict is None
    trials = queue.list_trials(node.engine, experiment_id=exp_id)
    assert {t.state for t in trials} == {"cancelled"}


@pytest.mark.parametrize(("spec", "field"), [
    (_spec(arms=({"name": "none"}, {"name": "int8", "compression": {"method": "int8"}})),
     "arms.1.compression.method"),
    (_spec(arms=({"name": "a"}, {"name": "b", "precision": "fp8"})), "arms.1.precision"),
    (_spec(arms=({"name": "a"}, {"name": "b", "compression": {"method": "int9"}})),
     "arms.1.compression.method"),
    (_spec(overrides={"model.n_layerz": 2}), "model.n_layerz"),
    (_spec(checkpoint_run=999, checkpoint_step=10), "checkpoint_run"),  # no such run
    (_spec(overrides={"data.paths": ["/etc"]}), "overrides.data.paths"),  # paths: config only
    (_spec(repeats=0), "repeats"),
    (_spec(mode="sideways"), "mode"),
])
def test_a_bad_forked_experiment_is_refused_and_nothing_recorded(
        tmp_path: Path, spec: ExperimentSpec, field: str) -> None:
    node = _node(tmp_path)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        asyncio.run(node.service.submit_experiment(spec))
    assert node.service.experiments() == [] and crud.list_runs(node.engine) == []


def _trial(arm: str, repeat: int, tps: float | None, val_loss: float = 2.0,
           error: str | None = None) -> queue.TrialView:
    done = tps is not None
    return queue.TrialView(
        id=repeat * 2 + (arm == "B"), experiment_id=1, arm_id=1 + (arm == "B"), arm_name=arm,
        repeat=repeat, state="done" if done else "failed", attempt=1, priority=0,
        lease_owner="node:1",
        result={"tokens_per_second": tps, "val_loss": val_loss} if done else None,
        error=error)


def test_judge_pairs_by_repeat_and_says_when_it_cannot() -> None:
    # The always-valid test cannot reject on fewer than ~6 pairs, however clear they are.
    paired = [_trial("A", r, 1000 + 10 * r) for r in range(8)] + [
        _trial("B", r, 1500 + 12 * r + r % 3) for r in range(8)]
    v = judge(["A", "B"], paired, loss_margin=0.05)["B"]
    assert v["kind"] == "better" and v["pairs"] == 8, v
    # One test behind the interval and the p beside it: the paired t test, read once.
    assert v["interval"] == "95% paired t interval" and v["p_value"] < 0.05, v
    assert v["low"] > 1 and v["quality"]["non_inferior"]

    one = judge(["A", "B"], [_trial("A", 0, 1000), _trial("B", 0, 1100)], loss_margin=0.05)
    assert one["B"]["kind"] == "inconclusive (budget spent)"
    assert "repeats" in one["B"]["reason"] and one["B"]["ratio"] == pytest.approx(1.1)

    # A failed trial breaks a pair: Welch on what finished, no sequential test.
    broken = [*paired[:-1], _trial("B", 3, None, error="boom")]
    v = judge(["A", "B"], broken, loss_margin=0.05)["B"]
    assert v["kind"] in KINDS and "left out" in v["reason"], v
    assert v["interval"] == "95% Welch t interval" and 0 <= v["p_value"] <= 1, v

    lost = [*paired[:8], *(_trial("B", r, None, error="oom") for r in range(8))]
    v = judge(["A", "B"], lost, loss_margin=0.05)["B"]
    assert v["kind"] == "failed (error)" and "oom" in v["reason"]


@pytest.mark.slow
def test_a_known_harmful_arm_is_rejected_on_its_own_weights(tmp_path: Path) -> None:
    """Top-k 1% without error feedback drops 99% of every gradient: known to hurt. Judged on
    shared weights (interleaved), its harm spread into the baseline's blocks and it passed
    (issue 14); on its own copy of the weights from one checkpoint, its validation loss is
    shown worse than the margin, and the verdict says so."""
    node = _node(tmp_path)
    topk = {"method": "topk", "topk_ratio": 0.01, "error_feedback": False}
    spec = _spec(steps=30, arms=({"name": "none", "compression": {"method": "none"}},
                                 {"name": "topk", "compression": topk}),
                 overrides={"job.nproc_per_node": 2})

    async def main() -> int:
        exp = await node.service.submit_experiment(spec)
        await _settle(node, exp.id)
        return exp.id

    found = node.service.experiment(asyncio.run(main()))
    assert found is not None and found.state == "done", found
    v = found.verdict["topk"]  # type: ignore[index]
    trials = queue.list_trials(node.engine, experiment_id=found.id)
    assert v["kind"] == "rejected (quality)", (v, [t.result for t in trials])
    q = v["quality"]
    assert q["measure"] == "validation loss" and q["status"] == "harm"
    assert q["lower"] > q["margin"] == 0.05, q
    assert "validation loss worse by more than the margin" in v["reason"]


@pytest.mark.slow
def test_a_forked_experiment_takes_an_earlier_ones_trials_and_checkpoint(tmp_path: Path) -> None:
    """The tuner's quality rounds name the search's earlier ones (``reuse``): an arm of the
    same setting takes their trials instead of training again, and the new arms start from the
    same checkpoint. The premise, checked: a trial run again from that checkpoint (``fp32-b``
    trains what ``fp32`` did, under another setting's text) ends at the same validation loss."""
    node = _node(tmp_path)
    again = {"name": "fp32-b", "precision": "fp32", "compression": {"method": "none"}}

    async def main() -> tuple[int, int]:
        first = await node.service.submit_experiment(_spec())
        await _settle(node, first.id)
        second = await node.service.submit_experiment(_spec(
            name="fork-2", arms=({"name": "bf16", "precision": "bf16"}, again),
            reuse=(first.id,)))
        await _settle(node, second.id)
        return first.id, second.id

    first, second = asyncio.run(main())
    old = {(t.arm_name, t.repeat): t for t in queue.list_trials(node.engine, experiment_id=first)}
    new = queue.list_trials(node.engine, experiment_id=second)
    assert [t.state for t in new] == ["done"] * 4, [t.error for t in new]
    checkpoint = str(tmp_path / "experiments" / str(first) / "base" / "step_00000010.pt")
    assert not (tmp_path / "experiments" / str(second) / "base").exists()  # no base job
    for t in new:
        r = t.result or {}
        assert r["checkpoint"] == checkpoint and r["resumed_from"] == 10
        if t.arm_name == "bf16":  # taken, not run: the earlier trial's result, and where from
            src = old[("bf16", t.repeat)]
            assert r["reused_from"] == {"experiment_id": first, "trial_id": src.id}
            assert {k: v for k, v in r.items() if k != "reused_from"} == src.result
        else:  # ran now, from the first one's checkpoint: the same loss as fp32 there
            assert "reused_from" not in r
            assert r["run_id"] not in {o.result["run_id"] for o in old.values()}  # type: ignore[index]
            assert r["val_loss"] == old[("fp32", t.repeat)].result["val_loss"]  # type: ignore[index]
    found = node.service.experiment(second)
    assert found is not None and found.state == "done" and "fp32-b" in found.verdict  # type: ignore[operator]
    view = queue.get_experiment(node.engine, experiment_id=second)
    assert view is not None and view.budget["reused_trials"] == 2
    assert view.budget["checkpoint"] == checkpoint
