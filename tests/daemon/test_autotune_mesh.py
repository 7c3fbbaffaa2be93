"""The auto-tuner's mesh dimension: the shapes of a world size, each as its arm's overrides or
left out with the mesh rules' own message (daemon/autotune/mesh.py), and the mesh stage in the
search: first, forked, its winner's mesh carried into every later stage (search.py)."""

from __future__ import annotations

from typing import Any

import pytest

from traind.daemon.autotune import mesh
from traind.daemon.autotune.search import (
    STAGES,
    Candidate,
    Hardware,
    Plan,
    Round,
    Space,
    candidates,
    first_rounds,
    needs_restart,
    next_round,
    record,
    setting_label,
    start,
)
from traind.daemon.experiments.specs import MESH_ARM_FIELDS
from traind.trainer.config import TrainConfig
from traind.trainer.mesh import MeshShape

NONE = {"method": "none"}


def _cfg(ranks: int = 4, *, heads: int = 4, layers: int = 4, batch: int = 4,
         **parallel: Any) -> TrainConfig:
    return TrainConfig.model_validate({
        "job": {"nproc_per_node": ranks, "batch_size": batch},
        "model": {"n_heads": heads, "n_layers": layers, "d_model": 32, "seq_len": 32},
        "parallel": parallel})


def _shape(dp: int, tp: int, pp: int, **extra: Any) -> dict[str, Any]:
    return {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp, **extra}


@pytest.mark.parametrize(("world", "shapes"), [
    (1, [(1, 1, 1)]),
    (2, [(2, 1, 1), (1, 2, 1), (1, 1, 2)]),
    (4, [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]),
    (6, [(6, 1, 1), (3, 2, 1), (2, 3, 1), (1, 6, 1), (3, 1, 2), (1, 3, 2), (2, 1, 3),
         (1, 2, 3), (1, 1, 6)]),
])
def test_every_shape_of_a_world_size_dp_only_first(world: int, shapes: list[Any]) -> None:
    assert mesh.shapes(world) == [MeshShape(*s) for s in shapes]
    assert len(mesh.shapes(8)) == 10  # (dp, tp, pp) with 2^3: C(5, 2)


def test_an_arm_of_a_job_that_sets_too_few_micro_batches_derives_them() -> None:
    """An explicit count below an arm's pp goes back to 0: the trainer's one rule
    (trainer/mesh.default_microbatches) picks the arm's, and the arm validates."""
    from traind.trainer.mesh import job_microbatches

    cfg = _cfg(tp=2, pp=2, dp=1, microbatches=2)  # a pp2 job that runs 2 micro-batches
    got, _ = mesh.settings(_cfg(microbatches=1))
    pp4 = next(t for t in got if t["parallel.pp"] == 4)
    assert pp4["parallel.microbatches"] == 0
    arm = TrainConfig.model_validate(cfg.model_dump() | {"parallel": {
        **cfg.parallel.model_dump(), "dp": 1, "tp": 1, "pp": 4, "microbatches": 0},
        "job": {**cfg.job.model_dump(), "batch_size": 16}})
    assert job_microbatches(arm) == 4


@pytest.mark.parametrize(("cfg", "ok", "refused"), [
    # the job's own dp4 is the baseline; each other shape keeps the global batch (4 x 4)
    (_cfg(), [_shape(2, 2, 1, **{"job.batch_size": 8}),
              _shape(1, 4, 1, **{"job.batch_size": 16}),
              _shape(2, 1, 2, **{"job.batch_size": 8}),
              _shape(1, 2, 2, **{"job.batch_size": 16}),
              _shape(1, 1, 4, **{"job.batch_size": 16})], {}),
    # two heads, two blocks: tp4 and pp4 are the rules' to refuse, in their words
    (_cfg(heads=2, layers=2),
     [_shape(2, 2, 1, **{"job.batch_size": 8}),
      _shape(2, 1, 2, **{"job.batch_size": 8}),
      _shape(1, 2, 2, **{"job.batch_size": 16})],
     {(1, 4, 1): "parallel.tp: 4 must divide model.n_heads (2): each rank computes whole "
                 "attention heads",
      (1, 1, 4): "parallel.pp: 4 stages need at least as many blocks; model.n_layers is 2"}),
    # zero1 runs on every shape (trainer/zero.py beside tp and pp): the strategy is kept
    (_cfg(strategy="zero1"),
     [_shape(2, 2, 1, **{"job.batch_size": 8}),
      _shape(1, 4, 1, **{"job.batch_size": 16}),
      _shape(2, 1, 2, **{"job.batch_size": 8}),
      _shape(1, 2, 2, **{"job.batch_size": 16}),
      _shape(1, 1, 4, **{"job.batch_size": 16})], {}),
    # hsdp's shard groups must divide each shape's dp: dp4 as 2 x 2 ranks, and dp1 ones
    (_cfg(strategy="hsdp", dp_shard=2),
     [_shape(2, 2, 1, **{"job.batch_size": 8}),
      _shape(1, 4, 1, **{"job.batch_size": 16}),
      _shape(2, 1, 2, **{"job.batch_size": 8}),
      _shape(1, 2, 2, **{"job.batch_size": 16}),
      _shape(1, 1, 4, **{"job.batch_size": 16})], {}),
    # the job's own mesh is dp2 x tp2 with one sequence per rank: dp4 cannot keep a global
    # batch of 2 (the tuner's rule); interleaved_1f1b refuses dp > 1 (the mesh's)
    (_cfg(batch=1, tp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
     [_shape(1, 4, 1, **{"job.batch_size": 2}),
      _shape(1, 2, 2, **{"job.batch_size": 2})],
     {(4, 1, 1): "job.batch_size: the arm keeps the job's global batch of 2 sequences "
                 "(job.batch_size x dp), which dp = 4 does not divide",
      (2, 1, 2): "parallel.pp_schedule: interleaved_1f1b with dp > 1 is not yet supported",
      (1, 1, 4): "parallel.pp_virtual_stages: interleaved_1f1b's 4 x 2 stages need at least"}),
])
def test_mesh_settings(cfg: TrainConfig, ok: list[dict[str, Any]],
                       refused: dict[tuple[int, int, int], str]) -> None:
    got, out = mesh.settings(cfg)
    assert got == ok
    reasons = {(t["parallel.dp"], t["parallel.tp"], t["parallel.pp"]): r for t, r in out}
    assert reasons.keys() == refused.keys()
    for shape, why in refused.items():
        assert reasons[shape].startswith(why), reasons[shape]
    for table in [*got, *(t for t, _ in out)]:  # what a forked arm may set
        assert set(table) <= MESH_ARM_FIELDS


def test_one_rank_has_no_other_shape() -> None:
    assert mesh.settings(_cfg(1)) == ([], [])
    assert "1 rank" in (mesh.skipped(1) or "") and mesh.skipped(2) is None


M = "fp32 \u00b7 none \u00b7 mesh "  # setting_label's separator, then the mesh


@pytest.mark.parametrize(("table", "name", "label"), [
    (_shape(2, 2, 1), "fp32.none.dp2tp2", M + "dp 2 \u00d7 tp 2 \u00d7 pp 1"),
    (_shape(1, 1, 4, **{"job.batch_size": 16, "parallel.microbatches": 4}), "fp32.none.pp4",
     M + "dp 1 \u00d7 tp 1 \u00d7 pp 4 (batch 16 per rank, "
     "4 micro-batches)"),
    (_shape(1, 4, 1, **{"parallel.strategy": "fsdp"}), "fp32.none.tp4",
     M + "dp 1 \u00d7 tp 4 \u00d7 pp 1 (fsdp)"),
    (_shape(1, 1, 1), "fp32.none.dp1", M + "dp 1 \u00d7 tp 1 \u00d7 pp 1"),
])
def test_a_mesh_candidate_is_named_and_labelled_readably(table: dict[str, Any], name: str,
                                                         label: str) -> None:
    c = Candidate("fp32", NONE, mesh=table)
    assert c.name == name and mesh.LABELLED.search(c.name)
    assert setting_label(c.as_dict()) == label
    assert Candidate.from_dict(c.as_dict()) == c
    assert c.arm()["mesh"] == table


HW4 = Hardware(device="cpu", ranks=4, strategy="ddp")
TP2 = _shape(2, 2, 1, **{"job.batch_size": 8})
PP2 = _shape(2, 1, 2, **{"job.batch_size": 8, "parallel.microbatches": 2})


def _plan(meshes: tuple[dict[str, Any], ...] = (TP2, PP2)) -> Plan:
    space = Space(precisions=("fp32", "bf16"), compressions=(NONE, {"method": "int8"}),
                  meshes=meshes)
    ok, out = candidates(space, HW4)
    assert out == []
    return start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30, hw=HW4)


def _run(plan: Plan, verdict: Any) -> tuple[Plan, list[Round]]:
    rounds = []
    while True:
        plan, rnd = next_round(plan)
        if rnd is None:
            return plan, rounds
        rounds.append(rnd)
        plan = record(plan, rnd, {c.name: verdict(rnd, c) for c in rnd.challengers})


def _better(*names: str) -> Any:
    def verdict(rnd: Round, c: Candidate) -> dict[str, Any]:
        if c.name in names:
            return {"kind": "better", "ratio": 1.3, "quality": {"status": "non-inferior"}}
        return {"kind": "worse", "ratio": 0.8}
    return verdict


def test_the_mesh_stage_comes_first_and_forked() -> None:
    assert STAGES[0] == "mesh"
    plan = _plan()
    assert [(r.stage, r.phase, r.forked, [c.name for c in r.challengers])
            for r in first_rounds(plan)] == [
        ("mesh", "speed", True, ["fp32.none.dp2tp2", "fp32.none.dp2pp2"]),
        ("precision", "speed", False, ["bf16.none"]),
        ("precision", "quality", True, ["bf16.none"]),
        ("compression", "speed", False, ["fp32.int8"]),
        ("compression", "quality", True, ["fp32.int8"]),
        ("joint", "speed", False, ["bf16.int8"]),
        ("joint", "quality", True, ["bf16.int8"]),
    ]


def test_a_tp_winner_is_carried_and_compression_is_not_proposed_on_it() -> None:
    plan, rounds = _run(_plan(), _better("fp32.none.dp2tp2", "bf16.none.dp2tp2"))
    assert [(r.stage, r.phase, r.baseline.name, [c.name for c in r.challengers])
            for r in rounds] == [
        ("mesh", "speed", "fp32.none", ["fp32.none.dp2tp2", "fp32.none.dp2pp2"]),
        # every later stage on the winner's mesh; no compression with tp > 1 (the one rule),
        # so no compression stage and no joint one
        ("precision", "speed", "fp32.none.dp2tp2", ["bf16.none.dp2tp2"]),
        ("precision", "quality", "fp32.none.dp2tp2", ["bf16.none.dp2tp2"]),
    ]
    assert plan.best == Candidate("bf16", NONE, mesh=TP2)
    assert "start one with parallel.dp=2, parallel.tp=2" in (needs_restart(plan.best) or "")
    # stored and read back mid-search, the plan goes on the same way
    assert Plan.from_dict(plan.as_dict()) == plan


def test_when_the_job_s_own_mesh_wins_compression_is_searched_as_before() -> None:
    plan, rounds = _run(_plan(), _better("fp32.int8"))
    assert needs_restart(plan.best) is None  # a running job switches compression
    assert [(r.stage, r.phase, [c.name for c in r.challengers]) for r in rounds] == [
        ("mesh", "speed", ["fp32.none.dp2tp2", "fp32.none.dp2pp2"]),
        ("precision", "speed", ["bf16.none"]),
        ("compression", "speed", ["fp32.int8"]),
        ("compression", "quality", ["fp32.int8"]),
        ("joint", "speed", ["bf16.int8"]),
    ]
    assert plan.best == Candidate("fp32", {"method": "int8"})


def test_without_meshes_there_is_no_mesh_stage() -> None:
    plan, rounds = _run(_plan(meshes=()), _better())
    assert "mesh" not in {r.stage for r in rounds} and plan.best.name == "fp32.none"


def test_compression_the_job_s_own_mesh_refuses_is_tried_on_a_winner_that_runs_it() -> None:
    """A dp2 x tp2 job: int8 needs DDP (tp = 1), so it is listed with the reason, and kept for
    a dp4 winner; when the job's own mesh stays best, it is never tried."""
    hw = Hardware(device="cpu", ranks=4, strategy="ddp", tp=2)
    dp4 = _shape(4, 1, 1, **{"job.batch_size": 2})
    space = Space(precisions=("fp32",), compressions=(NONE, {"method": "int8"}), meshes=(dp4,))
    ok, out = candidates(space, hw)
    assert [c.name for c in ok] == ["fp32.none", "fp32.int8", "fp32.none.dp4"]
    (refused, reason), = out
    assert refused.name == "fp32.int8" and "parallel.tp = 1 (not 2" in reason
    assert reason.endswith("tried if the mesh stage's winner runs it)")
    plan = start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30, hw=hw)
    assert [r.stage for r in first_rounds(plan)] == ["mesh"]

    _, rounds = _run(plan, _better("fp32.none.dp4"))
    assert [(r.stage, r.phase, [c.name for c in r.challengers]) for r in rounds] == [
        ("mesh", "speed", ["fp32.none.dp4"]),
        ("compression", "speed", ["fp32.int8.dp4"])]  # on the winner's mesh: DDP again
    _, rounds = _run(plan, _better())
    assert [r.stage for r in rounds] == ["mesh"]
