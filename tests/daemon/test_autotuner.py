"""The auto-tuner on a node with real jobs: rounds as experiments, stored, then promoted."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

import pytest

from traind.daemon.autotune.search import quality_status
from traind.daemon.config import ConfigError, load_settings
from traind.daemon.experiments.stats import KINDS
from traind.daemon.node import Node
from traind.daemon.service import AutotuneSpec

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

TINY = ["job.eval_every=1000", "job.eval_batches=1", "job.checkpoint_every=10",
        "job.threads=1", "job.batch_size=4", "model.seq_len=32", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "data.max_bytes=200000",
        "daemon.default_job=false"]


def _node(tmp_path: Path) -> Node:
    node = Node(load_settings(env={}, overrides=[*TINY, "job.steps=100000",
                                                 f"daemon.var_dir={tmp_path}"]))
    node.migrate()
    return node


SPEC = AutotuneSpec(name="cpu", precisions=("fp32", "bf16", "fp8"),
                    compressions=({"method": "none"}, {"method": "int8"}),
                    steps=40, max_rounds=1, block_steps=10, warmup_steps=2,
                    quality_steps=10, quality_repeats=2, overrides={"job.nproc_per_node": 2})


def test_a_search_runs_its_rounds_as_experiments_and_promotes_the_winner(
        tmp_path: Path) -> None:
    node = _node(tmp_path)

    async def main() -> tuple[int, int]:
        target = await node.submit(node.settings)  # the long-running job
        tune = await node.service.submit_autotune(dataclasses.replace(SPEC, target_run_id=target))
        await node.tuner.wait(tune.id)
        for _ in range(300):  # the promotion reaches the job at its next checkpoint
            if all(p.state != "pending" for p in node.service.promotions(target)):
                break
            await asyncio.sleep(0.1)
        await node.shutdown()
        return tune.id, target

    tune_id, target = asyncio.run(main())
    found = node.service.autotune(tune_id)
    assert found is not None and found.state == "done", found
    speed = [r for r in found.rounds if r["phase"] == "speed"]
    # the joint stage tries the other precision with int8, unless int8 showed harm
    harm = any(quality_status(v) == "harm" for r in found.rounds if r["stage"] == "compression"
               for v in r["verdicts"].values())
    assert [r["stage"] for r in speed] == ["precision", "compression",
                                           *([] if harm else ["joint"])]
    for r in found.rounds:  # a speed win is checked on its own weights before it counts
        exp = node.service.experiment(r["experiment_id"])
        assert exp is not None and exp.mode == ("forked" if r["phase"] == "quality"
                                                else "interleaved")
    # every quality round names the search's earlier ones, and takes the trials of an arm one
    # of them trained at the same length (the best so far) instead of training it again
    quality = [r for r in found.rounds if r["phase"] == "quality"]
    for i, r in enumerate(quality):
        assert r["reuse"] == [q["experiment_id"] for q in quality[:i]]
        trained = {(a["name"], q["steps"]) for q in quality[:i]
                   for a in (q["baseline"], *q["challengers"])}
        exp = node.service.experiment(r["experiment_id"])
        assert exp is not None
        taken = sum((a["name"], r["steps"]) in trained
                    for a in (r["baseline"], *r["challengers"]))
        assert exp.reused_trials == SPEC.quality_repeats * taken, (r, quality)
    precision, compression = speed[:2]
    assert precision["baseline"]["precision"] == "fp32"
    assert [c["precision"] for c in precision["challengers"]] == ["bf16"]
    # compression against uncompressed at the chosen precision
    best_precision = compression["baseline"]["precision"]
    assert [c["compression"] for c in compression["challengers"]] == [{"method": "int8"}]
    assert all(c["precision"] == best_precision for c in compression["challengers"])
    if not harm:  # then int8 at the precision the first stage did not choose
        joint = speed[2]
        assert [(c["precision"], c["compression"]) for c in joint["challengers"]] == [
            ({"fp32": "bf16", "bf16": "fp32"}[best_precision], {"method": "int8"})]
    for r in found.rounds:
        assert node.service.experiment(r["experiment_id"]).state == "done"
        assert all(v["kind"] in KINDS for v in r["verdicts"].values())
    # torchao is installed (the test extra), so fp8 could run here in its emulation: it is
    # left out for the tuner's own reason, not for the hardware
    assert found.infeasible and "fp8 cannot switch inside a running job" in \
        found.infeasible[0]["reason"]
    assert found.best is not None
    assert found.best["nothing_beat_baseline"] == (found.best["name"] == "fp32.none")
    # The rounds ran with 2 ranks (the search's overrides), the target job with 1: their
    # evidence says nothing of it, so nothing is sent and the row says why.
    (p,) = node.service.promotions(target)
    assert p.autotune_id == tune_id and p.evidence["rounds"] and p.seq is None
    assert p.state == "refused" and "job.nproc_per_node: 2 in experiment" in (p.reason or "")
    assert p.config_hash is not None and p.evidence_config_hash not in (None, p.config_hash)


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
