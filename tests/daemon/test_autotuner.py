"""The auto-tuner on a node with real jobs: rounds as experiments, stored, then promoted."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import pytest

from traind.daemon.autotune.search import quality_status
from traind.daemon.config import ConfigError, load_settings
from traind.daemon.db import crud
from traind.daemon.experiments.stats import KINDS
from traind.daemon.node import Node
from traind.daemon.promotion_guard import GuardPolicy
from traind.daemon.service import AutotuneSpec

if TYPE_CHECKING:
    from pathlib import Path

    from traind.daemon.service import ExperimentSpec

pytestmark = pytest.mark.slow

TINY = ["job.eval_every=1000", "job.eval_batches=1", "job.checkpoint_every=10",
        "job.threads=1", "job.batch_size=4", "model.seq_len=32", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "data.max_bytes=200000",
        "daemon.default_job=false"]


def _node(tmp_path: Path) -> Node:
    # Two ranks, as the searches run (their overrides): a promotion takes evidence measured
    # on the target's own configuration only (daemon/provenance.py's BASIS).
    node = Node(load_settings(env={}, overrides=[*TINY, "job.steps=100000",
                                                 "job.nproc_per_node=2",
                                                 f"daemon.var_dir={tmp_path}"]))
    node.migrate()
    return node


SPEC = AutotuneSpec(name="cpu", precisions=("fp32", "bf16", "fp8"),
                    compressions=({"method": "none"}, {"method": "int8"}),
                    steps=40, max_rounds=1, block_steps=10, warmup_steps=2,
                    quality_steps=10, quality_repeats=2, overrides={"job.nproc_per_node": 2})

# The winner is planted: in every speed round the job's own setting, fp32 with no
# compression, sleeps as long again as each of its steps took (ArmConfig.slowdown = 1, the
# known effect bench/ab_calibration.py plants), so int8 (about 0.87x of it unslowed on this
# host: its quantization costs more than a tiny model's all-reduce saves) runs ~1.7x as fast
# and is shown faster; its forked quality round, never slowed, finds its loss the same. The
# precisions are fp32 alone (fp8 cannot switch inside a job, left out): how bf16 compares with
# fp32 on a CPU is the host's, and would make the winner the host's too. The speed round's
# budget (50 pairs) is a ceiling: it ends at its verdict, measured here after 17 pairs (a
# pair's log ratio has sd 0.6 with the target job on the same two cores), ratio 1.70.
BASELINE, WINNER = "fp32.none", "fp32.int8"
PLANTED = AutotuneSpec(name="planted", precisions=("fp32", "fp8"),
                       compressions=({"method": "none"}, {"method": "int8"}),
                       steps=1000, max_rounds=1, block_steps=10, warmup_steps=2,
                       quality_steps=10, quality_repeats=2)


def _plant_slowdown(monkeypatch: pytest.MonkeyPatch) -> None:
    from traind.daemon.autotune import runner

    real = runner.round_spec

    def planted(spec: AutotuneSpec, tune_id: int, rnd: Any) -> ExperimentSpec:
        rs = real(spec, tune_id, rnd)
        if rs.mode != "interleaved":  # quality rounds (forked) run as they are
            return rs
        return dataclasses.replace(rs, arms=tuple(
            {**a, "slowdown": 1.0} if a["name"] == BASELINE else a for a in rs.arms))

    monkeypatch.setattr(runner, "round_spec", planted)


def test_a_search_runs_its_rounds_as_experiments_and_promotes_the_winner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plant_slowdown(monkeypatch)
    node = _node(tmp_path)
    # the guard never decides here (no block of its steps fills): the row stays as applied
    node.guard.policy = GuardPolicy(block=10**9)

    async def main() -> tuple[int, int]:
        target = await node.submit(node.settings)  # the long-running job, on two ranks
        tune = await node.service.submit_autotune(
            dataclasses.replace(PLANTED, target_run_id=target))
        await node.tuner.wait(tune.id)
        for _ in range(600):  # the promotion reaches the job at its next checkpoint
            if all(p.state != "pending" for p in node.service.promotions(target)):
                break
            await asyncio.sleep(0.1)
        await node.shutdown()
        return tune.id, target

    tune_id, target = asyncio.run(main())
    found = node.service.autotune(tune_id)
    assert found is not None and found.state == "done", found
    # fp8 is left out for the tuner's own reason (torchao, the test extra, could run it here
    # in its emulation), not for the hardware
    assert found.infeasible and "fp8 cannot switch inside a running job" in \
        found.infeasible[0]["reason"]
    # one stage, compression: a speed round (interleaved) that shows int8 faster, then its
    # quality round (forked: each arm trained on its own copy of the weights)
    assert [(r["stage"], r["phase"]) for r in found.rounds] == [
        ("compression", "speed"), ("compression", "quality")], found.rounds
    speed, quality = found.rounds
    for r, mode in ((speed, "interleaved"), (quality, "forked")):
        exp = node.service.experiment(r["experiment_id"])
        assert exp is not None and exp.mode == mode and exp.state == "done"
        assert r["baseline"]["name"] == BASELINE
        assert [c["name"] for c in r["challengers"]] == [WINNER]
        assert all(v["kind"] in KINDS for v in r["verdicts"].values())
    assert speed["verdicts"][WINNER]["kind"] == "better", speed["verdicts"]
    assert speed["verdicts"][WINNER]["ratio"] > 1
    assert quality_status(quality["verdicts"][WINNER]) == "non-inferior", quality["verdicts"]
    assert found.best is not None
    assert found.best["name"] == WINNER and not found.best["nothing_beat_baseline"]
    # The winner went to the target job, which applied it at a checkpoint boundary; the row
    # rests on evidence of its own configuration.
    (p,) = node.service.promotions(target)
    assert p.autotune_id == tune_id and p.evidence["rounds"] == found.rounds
    assert p.setting == {"precision": "fp32", "compression": {"method": "int8"}}
    assert p.previous["precision"] == "fp32" and p.previous["compression"]["method"] == "none"
    assert p.state == "applied", p
    assert p.seq is not None and p.reason is None
    assert p.applied_step is not None and p.applied_step % 10 == 0
    assert p.config_hash is not None and p.evidence_config_hash == p.config_hash


def test_a_bad_search_is_refused_with_the_field_and_nothing_recorded(tmp_path: Path) -> None:
    node = _node(tmp_path)
    bad = AutotuneSpec(name="bad", compressions=({"method": "int8", "int8_blok": 3},),
                       overrides={"job.nproc_per_node": 2})
    with pytest.raises(ConfigError, match="int8_blok"):
        asyncio.run(node.service.submit_autotune(bad))
    with pytest.raises(ConfigError, match="steps"):
        asyncio.run(node.service.submit_autotune(AutotuneSpec(name="x", steps=0)))
    with pytest.raises(ConfigError, match="target_run_id"):
        asyncio.run(node.service.submit_autotune(AutotuneSpec(name="x", target_run_id=99)))
    assert node.service.autotunes() == [] and node.service.experiments() == []


@pytest.mark.parametrize(("torchao", "fp8"), [(True, True), (False, False)])
def test_the_hardware_offers_fp8_where_torchao_can_run_it(
        monkeypatch: pytest.MonkeyPatch, torchao: bool, fp8: bool) -> None:
    """No GPU here: fp8 runs in torchao's emulation when torchao is installed (the trainer's
    rule, fp8_unsupported_reason; its table is in tests/trainer/test_precision.py)."""
    from traind.daemon.autotune import runner as autotuner
    from traind.daemon.devices import Devices

    monkeypatch.setattr(autotuner, "torchao_available", lambda: torchao)
    monkeypatch.setattr(autotuner, "read_devices", lambda: Devices(reason="none here"))
    settings = load_settings(env={}, overrides=TINY)
    hw = autotuner.hardware(settings, SPEC)
    assert hw.device == "cpu" and hw.ranks == 2 and hw.fp8 is fp8


def test_a_search_stopped_with_its_daemon_resumes_its_round_and_tests_its_winner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: a daemon stopped (SIGTERM's path: Node.shutdown) mid-round ended the search
    "done" with nothing beating the baseline, its challenger "failed" for a run that ended
    preempted. Now the round's experiment stays running, resumes in its run at the next
    start with the pairs it measured, and the search ends with the winner it tested."""
    _plant_slowdown(monkeypatch)
    node = _node(tmp_path)

    async def stopped_mid_round() -> tuple[int, int]:
        tune = await node.service.submit_autotune(PLANTED)
        exp_id = None
        for _ in range(1200):  # until the speed round has measured a few pairs
            await asyncio.to_thread(node.flusher.flush)  # serve's every second: live verdicts
            found = node.service.autotune(tune.id)
            current = [r for r in (found.rounds if found else []) if r.get("verdicts") is None]
            exp_id = current[0]["experiment_id"] if current else None
            exp = node.service.experiment(exp_id) if exp_id is not None else None
            pairs = [v.get("pairs", 0) for v in ((exp.verdict or {}) if exp else {}).values()
                     if isinstance(v, dict)]
            if pairs and max(pairs) >= 3:
                break
            await asyncio.sleep(0.5)
        assert exp_id is not None, "the speed round never measured a pair"
        await node.shutdown()
        return tune.id, exp_id

    tune_id, interrupted_id = asyncio.run(stopped_mid_round())
    exp = node.service.experiment(interrupted_id)
    assert exp is not None and exp.state == "running", exp  # neither failed nor decided
    assert exp.run_id is not None
    assert crud.get_run(node.engine, run_id=exp.run_id).state == "preempted"
    measured = exp.verdict[WINNER]["pairs"]
    found = node.service.autotune(tune_id)
    assert found is not None and found.state == "running", found  # not "done" untested

    again = _node(tmp_path)  # the next start: the search carries on

    async def next_start() -> None:  # serve's order
        await again.interleaved.resume_preempted()
        for t in again.tuner.unfinished():
            again.tuner.start(t)
        await again.tuner.wait(tune_id)
        await again.shutdown()

    asyncio.run(next_start())
    found = again.service.autotune(tune_id)
    assert found is not None and found.state == "done", found
    speed = found.rounds[0]
    assert (speed["stage"], speed["phase"]) == ("compression", "speed")
    assert speed["experiment_id"] == interrupted_id  # the same experiment, resumed
    resumed = again.service.experiment(interrupted_id)
    assert resumed is not None and resumed.state == "done"
    verdict = speed["verdicts"][WINNER]
    # Its pairs from before the stop count: the verdict has them and more.
    assert verdict["kind"] == "better" and verdict["pairs"] > measured, verdict
    assert found.best is not None and found.best["name"] == WINNER
    assert not found.best["nothing_beat_baseline"]
