"""The auto-tuner's runner with a scripted experiment service: what it submits per round
(speed rounds interleaved, quality rounds forked with their own budget and repeats), and what it
makes of the verdicts. The real jobs are tests/daemon/test_autotuner.py's."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from traind.daemon.autotune.runner import AutoTuner
from traind.daemon.config import ConfigError, load_settings
from traind.daemon.node import Node
from traind.daemon.service import AutotuneSpec

if TYPE_CHECKING:
    from pathlib import Path

    from traind.daemon.service import ExperimentSpec

TINY = ["job.threads=1", "job.batch_size=4", "model.seq_len=32", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "data.max_bytes=200000",
        "daemon.default_job=false", "job.nproc_per_node=2"]


class Scripted:
    """Experiments whose verdicts come from ``answer(spec)``: arm name -> verdict."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.submitted, self._verdicts = answer, [], {}

    async def submit_experiment(self, spec: ExperimentSpec) -> Any:
        self.submitted.append(spec)
        self._verdicts[len(self.submitted)] = self.answer(spec)
        return SimpleNamespace(id=len(self.submitted))

    async def wait_ended(self, experiment_id: int) -> Any:
        return SimpleNamespace(verdict=self._verdicts[experiment_id])

    async def cancel_experiment(self, experiment_id: int) -> None:
        pass


def _tune(tmp_path: Path, spec: AutotuneSpec, answer: Any) -> tuple[Any, Scripted]:
    node = Node(load_settings(env={}, overrides=[*TINY, f"daemon.var_dir={tmp_path}"]))
    node.migrate()
    scripted = Scripted(answer)

    async def promote(*args: Any, **kw: Any) -> None:
        raise AssertionError("no target run: nothing to promote")

    tuner = AutoTuner(settings=node.settings, engine=node.engine, runs=node.supervisor,
                      experiments=scripted, promote=promote)  # type: ignore[arg-type]

    async def main() -> Any:
        info = await tuner.submit(spec)
        await tuner.wait(info.id)
        return tuner.get(info.id)

    return asyncio.run(main()), scripted


def test_a_speed_winner_faces_a_forked_quality_round_and_harm_keeps_it_out(
        tmp_path: Path) -> None:
    spec = AutotuneSpec(name="q", precisions=("fp32", "bf16"),
                        compressions=({"method": "none"},), steps=120, block_steps=20,
                        quality_steps=30, quality_repeats=3, min_effect=0.05,
                        equivalence=0.03)

    def answer(s: ExperimentSpec) -> dict[str, Any]:
        if s.mode == "interleaved":
            return {"bf16.none": {"kind": "better", "ratio": 1.4}}
        return {"bf16.none": {"kind": "rejected (quality)", "ratio": 1.3,
                              "quality": {"status": "harm"}}}

    found, scripted = _tune(tmp_path, spec, answer)
    assert found.state == "done", found
    speed, quality = scripted.submitted
    assert (speed.mode, speed.steps, speed.min_effect, speed.equivalence) == (
        "interleaved", 120, 0.05, 0.03)
    assert (quality.mode, quality.steps, quality.repeats) == ("forked", 30, 3)
    assert [a["name"] for a in quality.arms] == ["fp32.none", "bf16.none"]
    assert "quality" in quality.name
    assert [(r["stage"], r["phase"]) for r in found.rounds] == [
        ("precision", "speed"), ("precision", "quality")]
    assert found.rounds[1]["speed"] == {"bf16.none": 1.4}
    assert found.best["name"] == "fp32.none" and found.best["nothing_beat_baseline"]


def test_quality_rounds_can_be_turned_off(tmp_path: Path) -> None:
    spec = AutotuneSpec(name="q", precisions=("fp32", "bf16"),
                        compressions=({"method": "none"},), steps=120, quality_steps=0)
    found, scripted = _tune(tmp_path, spec,
                            lambda s: {"bf16.none": {"kind": "better", "ratio": 1.4}})
    assert [s.mode for s in scripted.submitted] == ["interleaved"]
    assert found.best["name"] == "bf16.none" and not found.best["nothing_beat_baseline"]


def test_a_rounds_budget_is_per_arm_and_a_budget_too_small_is_refused_up_front(
        tmp_path: Path) -> None:
    """Three compression arms and the baseline in one interleaved round need 2 x 20 x 4 steps
    at least. A round's budget is per arm (steps per two arms), so the 80 steps a two-arm
    round needs give that round 160; 60 steps are refused at the submit, naming the field,
    before anything is recorded."""
    three = ({"method": "int8"}, {"method": "fp16"}, {"method": "bf16"})
    spec = AutotuneSpec(name="q", precisions=("fp32",), steps=80, block_steps=20,
                        compressions=three)
    _, scripted = _tune(tmp_path, spec, lambda s: {})
    assert (len(scripted.submitted[0].arms), scripted.submitted[0].steps) == (4, 160)
    small = dataclasses.replace(spec, steps=60)
    with pytest.raises(ConfigError, match="steps") as e:
        _tune(tmp_path / "small", small, lambda s: {})
    assert "int8" in str(e.value)


def test_a_mesh_stage_forks_each_shape_and_carries_the_winner(tmp_path: Path) -> None:
    """Two ranks, one block: tp2 runs (each arm at the job's global batch of 2 x 4), pp2 is
    the rules' to refuse. tp2 wins its forked round; the precision stage then runs on it,
    interleaved in one job on that mesh, and int8 (which needs DDP, tp = 1) is never tried."""
    spec = AutotuneSpec(name="m", precisions=("fp32", "bf16"), mesh=True, steps=120,
                        block_steps=20, quality_steps=30, repeats=2)

    def answer(s: ExperimentSpec) -> dict[str, Any]:
        if "mesh" in s.name:
            return {"fp32.none.tp2": {"kind": "better", "ratio": 1.3,
                                      "quality": {"status": "non-inferior"}}}
        return {"bf16.none.tp2": {"kind": "worse", "ratio": 0.9}}

    found, scripted = _tune(tmp_path, spec, answer)
    assert found.state == "done", found
    mesh, precision = scripted.submitted
    assert (mesh.mode, mesh.steps, mesh.repeats) == ("forked", 120, 2)
    assert mesh.arms == (
        {"name": "fp32.none", "precision": "fp32", "compression": {"method": "none"}},
        {"name": "fp32.none.tp2", "precision": "fp32", "compression": {"method": "none"},
         "mesh": {"parallel.dp": 1, "parallel.tp": 2, "parallel.pp": 1,
                  "job.batch_size": 8}})
    assert mesh.overrides["parallel.sharded_checkpoints"] is True  # resharded on load
    # the winner's mesh is the job's in the next stage: in the overrides, not the arms
    assert precision.mode == "interleaved"
    assert [a["name"] for a in precision.arms] == ["fp32.none.tp2", "bf16.none.tp2"]
    assert not any("mesh" in a for a in precision.arms)
    assert {k: precision.overrides[k] for k in ("parallel.tp", "job.batch_size")} == {
        "parallel.tp": 2, "job.batch_size": 8}
    assert [(r["stage"], r["phase"]) for r in found.rounds] == [
        ("mesh", "speed"), ("precision", "speed")]
    assert found.best["name"] == "fp32.none.tp2" and not found.best["nothing_beat_baseline"]
    # no running job can take a mesh: the best says what to start one with
    assert found.best["needs_restart"] == (
        "a job builds its mesh when it starts: start one with parallel.dp=1, parallel.tp=2, "
        "parallel.pp=1, job.batch_size=8")
    left_out = {x["candidate"]: x["reason"] for x in found.infeasible}
    assert left_out["fp32.none.pp2"].startswith(
        "parallel.pp: 2 stages need at least as many blocks; model.n_layers is 1")


def test_one_rank_skips_the_mesh_stage_and_says_why(tmp_path: Path) -> None:
    spec = AutotuneSpec(name="m", precisions=("fp32",), compressions=({"method": "none"},),
                        mesh=True, overrides={"job.nproc_per_node": 1})
    found, scripted = _tune(tmp_path, spec, lambda s: {})
    assert scripted.submitted == [] and found.best["nothing_beat_baseline"]
    (skipped,) = found.infeasible
    assert skipped["candidate"] == "mesh" and "its only mesh is dp1" in skipped["reason"]


def test_a_tp_job_moved_to_dp_has_its_compression_tried_there(tmp_path: Path) -> None:
    """A tp2 job cannot compress (no DDP); the search keeps int8 for a dp2 winner, checks it
    up front on dp2, and tries it there, in one interleaved job on the winner's mesh."""
    spec = AutotuneSpec(name="m", precisions=("fp32",), mesh=True, steps=120,
                        overrides={"parallel.tp": 2}, quality_steps=0)

    def answer(s: ExperimentSpec) -> dict[str, Any]:
        if "mesh" in s.name:
            return {"fp32.none.dp2": {"kind": "better", "ratio": 1.2,
                                      "quality": {"status": "non-inferior"}}}
        return {"fp32.int8.dp2": {"kind": "worse", "ratio": 0.9}}

    found, scripted = _tune(tmp_path, spec, answer)
    assert found.state == "done", found
    assert [(s.mode, [a["name"] for a in s.arms]) for s in scripted.submitted] == [
        ("forked", ["fp32.none", "fp32.none.dp2"]),
        ("interleaved", ["fp32.none.dp2", "fp32.int8.dp2"])]
    compression = scripted.submitted[1]
    assert (compression.overrides["parallel.dp"], compression.overrides["parallel.tp"]) == (2, 1)
    assert found.best["name"] == "fp32.none.dp2"
    left_out = {x["candidate"]: x["reason"] for x in found.infeasible}
    assert "tried if the mesh stage's winner runs it" in left_out["fp32.int8"]
