"""Tensor parallel on real gloo ranks under torchrun: tp2 (2 ranks) and dp2 x tp2 (4 ranks)
follow the one-rank run's losses step by step, and a tp checkpoint resumes on its mesh.

Why not bitwise: a row-parallel layer sums its partial products over the tp ranks (a
reduce-scatter) where one rank sums them inside one matmul, and the dp ranks average two
half-batch gradients where one rank takes one backward over the whole batch: the same math
in another order, so float32 rounding differs in the last bits and Adam carries it on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.trainer.mesh_runs import STEPS, config, run_ranks
from traind.contracts.events import CommEvent, LifecycleEvent, StepEvent
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
# fp32, relative per step: reordered float32 sums over 8 steps of Adam; measured 1.3e-7 at
# worst (tp2, dp2 x tp2 under ddp and fsdp alike), about float32's epsilon
FP32_RTOL = 1e-5


def losses(events: list[Any]) -> dict[int, float]:
    return {e.step: e.loss for e in events if isinstance(e, StepEvent)}


def one_rank(cfg: dict[str, Any]) -> dict[int, float]:
    sink = ListSink()
    train(TrainConfig.model_validate(cfg), sink)
    return losses(sink.events)


def assert_close(got: dict[int, float], want: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, expected in want.items():
        assert abs(got[step] - expected) <= rtol * abs(expected), (step, got[step], expected)


@pytest.mark.parametrize(("precision", "rtol"), [
    ("fp32", FP32_RTOL),
    # bf16 autocast rounds each matmul's output, and sharded matmuls round other partial
    # sums (measured 1.5e-4 at worst)
    ("bf16", 2e-3),
    # fp8 (torchao's emulation here): each shard's matmul inputs are cast with the scale of
    # the whole tensor (tensorwise: its amax all-reduced over the shards) or of each row;
    # measured 4.4e-4 (tensorwise) and 2.9e-4 (rowwise) at worst
    ("fp8", 2e-3),
    ("fp8 rowwise", 2e-3),
])
def test_tp2_follows_one_rank(tmp_path: Path, precision: str, rtol: float) -> None:
    mode, _, recipe = precision.partition(" ")
    section = {"mode": mode, **({"fp8_recipe": recipe} if recipe else {})}
    # bf16 runs grouped-query attention (4 query heads, 2 kv heads): each tp rank holds 2
    # query heads and the 1 kv head they read; the others, plain multi-head attention
    model = {"n_kv_heads": 2} if mode == "bf16" else {}
    reference = one_rank(config(tmp_path / "one", batch=4, precision=section, model=model))
    ranks = run_ranks(tmp_path / "tp", config(tmp_path / "tp", batch=4, ranks=2,
                                              parallel={"tp": 2}, precision=section,
                                              model=model, telemetry={"layer_every": 3}), 2)
    started = next(e for e in ranks[0] if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started.detail["mesh"] == {"dp": 1, "tp": 2, "pp": 1}
    assert started.detail["strategy"] == "tp"
    if mode == "fp8":  # the sharded layers really are Float8Linear (not a bf16 run)
        assert started.detail["fp8_layers"], started.detail
    assert losses(ranks[0]) == losses(ranks[1])  # one batch, one loss: the tp group agrees
    assert_close(losses(ranks[0]), reference, rtol)
    for events in ranks:
        # fp8's casts add their own collectives (a tensorwise scale's amax all-reduced)
        assert_tp_collectives(events, exact=mode != "fp8")


def assert_tp_collectives(events: list[Any], *, exact: bool = True) -> None:
    """Every third step's DTensor collectives (telemetry.layer_every, and the last step's),
    in a comm event of mesh_dim tp standing for the steps since the last: sequence
    parallel's all-gathers and reduce-scatters, with bytes and time, the hook's fields zero."""
    comm = [e for e in events if isinstance(e, CommEvent)]
    assert {e.mesh_dim for e in comm} == {"tp"}  # no DDP hook with tp: no dp event
    assert [(e.step, e.steps) for e in comm] == [(3, 3), (6, 3), (8, 2)]
    for e in comm:
        ops = {c["op"] for c in e.collectives}
        assert {"all_gather", "reduce_scatter"} <= ops, ops
        assert e.world_size == 2 and e.raw_bytes == 0
        assert all(c["bytes"] > 0 and c["calls"] > 0 and c["seconds"] > 0
                   for c in e.collectives)
        assert e.allreduce_seconds > 0
    # the same collectives every step: a fixed function of the model and the batch shape.
    # Forward: 2 blocks x (2 all-gathers + 2 reduce-scatters), the embedding's reduce-scatter,
    # the head's all-gathers of its input and of the logits; backward: each the other way,
    # but the logits' (Replicate -> Shard is a local slice)
    per_step = [sorted((c["op"], c["size"], c["calls"] // e.steps, c["bytes"] // e.steps)
                       for c in e.collectives) for e in comm]
    assert all(p == per_step[0] for p in per_step), per_step
    if not exact:
        return
    calls: dict[str, int] = {}
    for op, _, n, _ in per_step[0]:
        calls[op] = calls.get(op, 0) + n
    assert calls == {"all_gather": 11, "reduce_scatter": 10}, calls  # over size buckets


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dp2_tp2_follows_one_rank_of_the_whole_batch(tmp_path: Path, strategy: str) -> None:
    reference = one_rank(config(tmp_path / "one", batch=8))
    ranks = run_ranks(tmp_path / "4", config(tmp_path / "4", batch=4, ranks=4,
                                             parallel={"tp": 2, "strategy": strategy}), 4)
    per_rank = [losses(events) for events in ranks]
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]  # tp groups agree
    assert per_rank[0] != per_rank[2]  # the two dp groups read different halves
    mean = {s: (per_rank[0][s] + per_rank[2][s]) / 2 for s in per_rank[0]}
    assert_close(mean, reference, FP32_RTOL)


def test_tp2_checkpoint_resumes_on_the_same_mesh(tmp_path: Path) -> None:
    # the uninterrupted run: the one-rank one, which tp2 follows (test_tp2_follows_one_rank);
    # in process, a torchrun job fewer
    whole = one_rank(config(tmp_path / "one", batch=4))
    half = STEPS // 2
    out = tmp_path / "split"
    run_ranks(out, config(out, batch=4, ranks=2, steps=half, parallel={"tp": 2}), 2)
    assert (out / f"dcp_step_{half:08d}").is_dir()  # DTensor shards: DCP, always
    resumed = run_ranks(out / "again", config(out, batch=4, ranks=2, parallel={"tp": 2}), 2)
    got = losses(resumed[0])
    assert sorted(got) == list(range(half + 1, STEPS + 1))
    for step, loss in got.items():  # the same state, the same batches: the same losses
        assert abs(loss - whole[step]) <= FP32_RTOL * loss, step
