"""The mesh's rules (trainer/mesh.py) as tables: each bad combination names its field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from traind.trainer.config import TrainConfig
from traind.trainer.mesh import (
    MeshShape,
    default_microbatches,
    dp_coordinate,
    hsdp_shard,
    job_microbatches,
    pp_coordinate,
    shape_problems,
    tp_problems,
)

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32}


@pytest.mark.parametrize(("dp", "tp", "pp", "world", "shape", "field"), [
    (None, 1, 1, 1, MeshShape(1, 1), None),
    (None, 2, 1, 4, MeshShape(2, 2), None),  # dp inferred
    (0, 2, 1, 2, MeshShape(1, 2), None),  # 0 is inferred too
    (2, 2, 1, 4, MeshShape(2, 2), None),
    (2, 2, 1, 8, None, "dp"),  # product is not the world size
    (None, 3, 1, 4, None, "tp"),  # tp does not divide the world: dp cannot be inferred
    (None, 1, 2, 2, MeshShape(1, 1, 2), None),  # pipeline parallel
    (None, 1, 2, 4, MeshShape(2, 1, 2), None),  # pp2 x dp2, dp inferred
    (None, 2, 2, 6, None, "tp"),  # tp x pp does not divide the world
])
def test_shape(dp: int | None, tp: int, pp: int, world: int, shape: MeshShape | None,
               field: str | None) -> None:
    got, problems = shape_problems(dp, tp, pp, world)
    assert got == shape
    assert [loc for loc, _ in problems] == ([] if field is None else [("parallel", field)])


@pytest.mark.parametrize(("tp", "sizes", "says"), [
    (2, (4, 4, 96, 256, 32), []),
    (4, (4, 4, 96, 256, 32), []),
    (2, (6, 6, 96, 255, 33), ["vocab_size", "seq_len"]),
    (2, (6, 3, 96, 256, 32), ["kv heads"]),  # grouped-query attention
    (2, (8, 2, 96, 256, 32), []),
    (2, (8, 1, 96, 256, 32), ["kv heads"]),  # multi-query: one kv head cannot be split
    (4, (6, 6, 96, 256, 32), ["n_heads"]),
    (2, (4, 4, 97, 256, 32), ["MLP hidden"]),
])
def test_what_tp_must_divide(tp: int, sizes: tuple[int, ...], says: list[str]) -> None:
    heads, kv, hidden, vocab, seq = sizes
    problems = tp_problems(tp, n_heads=heads, n_kv_heads=kv, mlp_hidden=hidden, vocab=vocab,
                           seq_len=seq)
    assert all(loc == ("parallel", "tp") for loc, _ in problems)
    assert len(problems) == len(says)
    for (_, msg), what in zip(problems, says, strict=True):
        assert what in msg


@pytest.mark.parametrize(("overrides", "loc", "says"), [
    # job.nproc_per_node left at 1: tp2 on one rank
    ({"parallel": {"tp": 2}, "job": {}}, "parallel.tp", "divide the world size 1"),
    ({"parallel": {"tp": 3}}, "parallel.tp", "must divide the world size 4"),
    ({"parallel": {"tp": 2, "dp": 4}}, "parallel.dp", "= 8 must equal the world size 4"),
    ({"parallel": {"pp": 3}, "job": {"nproc_per_node": 3}}, "parallel.pp",
     "model.n_layers is 2"),
    ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2},
      "job": {"nproc_per_node": 2}}, "parallel.pp_virtual_stages", "model.n_layers is 2"),
    ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 5},
      "job": {"nproc_per_node": 2, "batch_size": 10}, "model": {**TINY, "n_layers": 4}},
     "parallel.microbatches", "2 rounds of pp = 2"),
    ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2},
      "model": {**TINY, "n_layers": 4}}, "parallel.pp_schedule",
     "interleaved_1f1b with dp > 1"),
    ({"parallel": {"pp": 2, "microbatches": 1}}, "parallel.microbatches",
     "at least one micro-batch per stage"),
    ({"parallel": {"pp": 2, "microbatches": 3}, "job": {"nproc_per_node": 4, "batch_size": 4}},
     "parallel.microbatches", "must divide job.batch_size (4)"),
    ({"parallel": {"pp": 2, "microbatches": 2}, "compression": {"method": "int8"}},
     "compression.method", "parallel.pp = 1"),
    ({"parallel": {"tp": 4}, "model": {**TINY, "n_heads": 2}}, "parallel.tp",
     "must divide model.n_heads (2)"),
    ({"parallel": {"tp": 2}, "compression": {"method": "int8"}}, "compression.method",
     "parallel.tp = 1"),
    ({"parallel": {"strategy": "hsdp", "dp_shard": 3}}, "parallel.dp_shard",
     "parallel.dp_shard = 3 must divide dp (4)"),
    # three nodes of four, two stages of six: a node's four ranks are no group of a stage's
    ({"parallel": {"strategy": "hsdp", "pp": 2, "microbatches": 2},
      "job": {"nproc_per_node": 4, "nnodes": 3, "batch_size": 4,
              "rdzv_endpoint": "10.0.0.1:29400"}},
     "parallel.dp_shard", "the dp ranks of one node (4: job.nproc_per_node / tp) must divide "
     "dp (6)"),
    ({"parallel": {"tp": 2, "strategy": "fsdp"}, "compression": {"method": "topk"}},
     "compression.method", "parallel.strategy ddp or zero1"),
    # the model's real kv heads, not its query heads
    ({"parallel": {"tp": 4}, "model": {**TINY, "n_kv_heads": 2}}, "parallel.tp",
     "must divide the kv heads (2)"),
    ({"parallel": {"tp": 2}, "model": {**TINY, "tie_embeddings": True}},
     "model.tie_embeddings", "parallel.tp = 2"),
    ({"parallel": {"pp": 2, "microbatches": 2}, "model": {**TINY, "tie_embeddings": True}},
     "model.tie_embeddings", "parallel.pp = 2"),
    # parallel.microbatches left at 0 and nothing to derive: the batch is one sequence
    ({"parallel": {"pp": 2}, "job": {"nproc_per_node": 2, "batch_size": 1}},
     "parallel.microbatches", "set job.batch_size to a multiple of 2"),
    ({"parallel": {"pp": 2, "pp_schedule": "gpipe"}, "job": {"batch_size": 1}},
     "parallel.microbatches", "parallel.pp = 2 and job.batch_size = 1"),
    # interleaved: 2 does not divide 9, and 9 micro-batches are 4 rounds of 2
    ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b"},
      "job": {"nproc_per_node": 2, "batch_size": 9}, "model": {**TINY, "n_layers": 4}},
     "parallel.microbatches", "parallel.microbatches to a divisor of it that "
     "interleaved_1f1b runs"),
])
def test_bad_meshes_name_the_field(overrides: dict[str, Any], loc: str, says: str) -> None:
    tree: dict[str, Any] = {"job": {"nproc_per_node": 4}, "model": TINY, **overrides}
    with pytest.raises(ValidationError) as exc:
        TrainConfig.model_validate(tree)
    assert f"{loc}: " in str(exc.value) and says in str(exc.value)


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 2, "strategy": "fsdp"},
                                      {"tp": 4}, {"tp": 2, "dp": 2}, {},
                                      {"pp": 2, "microbatches": 2},
                                      {"pp": 2},  # microbatches derived: 2
                                      {"pp": 2, "pp_schedule": "gpipe", "microbatches": 1},
                                      {"pp": 2, "strategy": "fsdp", "microbatches": 4},
                                      {"pp": 2, "pp_schedule": "gpipe", "dp": 2},
                                      {"pp": 2, "tp": 2, "microbatches": 2},
                                      # ZeRO-1 over dp beside tp and pp (trainer/zero.py)
                                      {"tp": 2, "strategy": "zero1"},
                                      {"pp": 2, "strategy": "zero1", "microbatches": 2},
                                      {"strategy": "hsdp"}, {"strategy": "hsdp", "dp_shard": 2},
                                      {"strategy": "hsdp", "tp": 2, "dp_shard": 1}])
def test_good_meshes_validate(parallel: dict[str, Any]) -> None:
    TrainConfig.model_validate({"job": {"nproc_per_node": 4}, "model": TINY,
                                "parallel": parallel})


@pytest.mark.parametrize(("pp", "schedule", "batch", "want"), [
    (1, "1f1b", 8, 1),  # no pipeline: the batch is one micro-batch
    (1, "gpipe", 3, 1),
    (2, "1f1b", 8, 2),  # pp divides the batch: one micro-batch per stage
    (2, "gpipe", 8, 2),
    (2, "interleaved_1f1b", 8, 2),
    (4, "1f1b", 8, 4),
    (4, "1f1b", 4, 4),  # micro-batches of one sequence, and pp of them
    (3, "1f1b", 9, 3),
    (2, "1f1b", 9, 9),  # 2 does not divide 9: one sequence each
    (4, "gpipe", 6, 6),
    (2, "interleaved_1f1b", 3, 3),  # 3 < 2 x 2: one round of 3
    (2, "interleaved_1f1b", 9, None),  # 9 in 4 rounds of 2: torch refuses
    (2, "1f1b", 1, None),  # one sequence cannot fill two stages
    (2, "gpipe", 1, None),  # gpipe would run it, but a stage idles at every tick
    (4, "1f1b", 3, None),
])
def test_microbatches_left_at_0_are_derived(pp: int, schedule: str, batch: int,
                                            want: int | None) -> None:
    assert default_microbatches(pp, schedule=schedule, batch_size=batch) == want


@pytest.mark.parametrize(("parallel", "job", "want"), [
    ({"pp": 2}, {"nproc_per_node": 2}, 2),  # traind run --set job.nproc_per_node=2 ... pp=2
    ({"pp": 2, "pp_schedule": "gpipe"}, {"nproc_per_node": 2, "batch_size": 6}, 2),
    ({"pp": 4}, {"nproc_per_node": 4, "batch_size": 6}, 6),
    ({"pp": 2, "microbatches": 4}, {"nproc_per_node": 2}, 4),  # given: kept
    ({"pp": 2, "pp_schedule": "gpipe", "microbatches": 1}, {"nproc_per_node": 2}, 1),
    ({}, {}, 1),
])
def test_a_config_runs_the_derived_count_and_records_it_unset(
        parallel: dict[str, Any], job: dict[str, Any], want: int) -> None:
    model = {**TINY, "n_layers": 4}
    cfg = TrainConfig.model_validate({"job": job, "model": model, "parallel": parallel})
    assert job_microbatches(cfg) == want
    # the recorded config keeps what the user gave (0: derived) and validates again as it is
    tree = cfg.model_dump(mode="json")
    assert tree["parallel"]["microbatches"] == parallel.get("microbatches", 0)
    assert TrainConfig.model_validate(tree) == cfg


def test_a_recorded_config_asked_for_a_pipeline_later_derives_it_again() -> None:
    """A run's recorded config with an override (an experiment's, a forked trial's) that
    turns pp on: the derivation follows the new mesh, as no count recorded at pp = 1 could."""
    tree = TrainConfig.model_validate({"model": TINY}).model_dump(mode="json")
    tree["job"] = {**tree["job"], "nproc_per_node": 2}
    tree["parallel"] = {**tree["parallel"], "pp": 2}
    assert job_microbatches(TrainConfig.model_validate(tree)) == 2


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 4}, {"tp": 2, "strategy": "fsdp"}])
def test_grouped_query_attention_shards_over_tp(parallel: dict[str, Any]) -> None:
    TrainConfig.model_validate({"job": {"nproc_per_node": 4},
                                "model": {**TINY, "n_heads": 8, "n_kv_heads": 4},
                                "parallel": parallel})


@pytest.mark.parametrize("parallel", [{}, {"strategy": "fsdp"}, {"strategy": "zero1"}])
def test_tied_embeddings_run_data_parallel(parallel: dict[str, Any]) -> None:
    TrainConfig.model_validate({"job": {"nproc_per_node": 4},
                                "model": {**TINY, "tie_embeddings": True},
                                "parallel": parallel})


def test_tp_ranks_of_a_dp_group_share_a_coordinate() -> None:
    shape = MeshShape(dp=2, tp=2)
    assert [dp_coordinate(shape, r) for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(("shape", "dp", "pp"), [
    # pp outermost: a pipeline's stages are world / pp ranks apart
    (MeshShape(dp=1, tp=1, pp=2), [0, 0], [0, 1]),
    (MeshShape(dp=2, tp=1, pp=2), [0, 1, 0, 1], [0, 0, 1, 1]),
    (MeshShape(dp=2, tp=2, pp=2), [0, 0, 1, 1] * 2, [0] * 4 + [1] * 4),
])
def test_coordinates(shape: MeshShape, dp: list[int], pp: list[int]) -> None:
    assert [dp_coordinate(shape, r) for r in range(shape.world)] == dp
    assert [pp_coordinate(shape, r) for r in range(shape.world)] == pp


@pytest.mark.parametrize(("dp", "tp", "dp_shard", "nproc", "shard"), [
    (8, 1, 0, 4, 4),  # two nodes of four: shard inside each, replicate across
    (4, 2, 0, 4, 2),  # a node's four ranks are two tp pairs: two dp coordinates
    (2, 1, 0, 8, 2),  # one node holds every dp rank (with pp across nodes): plain fsdp
    (8, 1, 2, 4, 2),  # parallel.dp_shard decides
    (2, 4, 0, 2, 1),  # tp wider than a node: one dp rank per shard group
])
def test_hsdp_shards_over_one_nodes_dp_ranks(dp: int, tp: int, dp_shard: int, nproc: int,
                                             shard: int) -> None:
    assert hsdp_shard(dp, tp=tp, dp_shard=dp_shard, nproc_per_node=nproc) == shard
