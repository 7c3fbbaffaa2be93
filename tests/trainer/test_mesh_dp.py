"""The mesh's dp dimension on real gloo ranks under torchrun, beyond ddp and fsdp.

ZeRO-1 beside tensor and pipeline parallel (trainer/zero.py): dp2 x tp2 and pp2 x dp2 train
exactly as the same mesh with its optimizer state replicated (ddp), while each dp rank holds
only its share of that state; and a zero1 checkpoint, each parameter's state written once by
its owner, resumes onto another mesh (zero1 pp2 x dp2, where other ranks own other
parameters) and onto one rank.

HSDP (``strategy = hsdp``): dp4 as 2 replicas x 2 shards, alone and beside tp2, follows the
one-rank run of the whole batch while each rank holds a half (a quarter with tp2) of the
state; its checkpoint resumes on one rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.trainer.mesh_runs import STEPS, config, run_ranks
from tests.trainer.test_mesh_layouts import steps
from tests.trainer.test_mesh_resume import FP32_RTOL, assert_follows, losses, one_rank
from traind.contracts.events import LifecycleEvent
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import ListSink
from traind.trainer.zero import partition

if TYPE_CHECKING:
    from pathlib import Path

# fp32, relative per step: zero1 steps each parameter with the same fused AdamW arithmetic
# as ddp, on its owner, and sends the result; measured 0 (bitwise) on this CPU
SAME_RTOL = 1e-6


def test_partition_balances_whole_tensors_largest_first() -> None:
    assert partition([10, 1, 1, 8], 2) == [0, 1, 1, 1]
    assert partition([4, 4, 4, 4], 4) == [0, 1, 2, 3]
    assert partition([5, 3, 2], 1) == [0, 0, 0]
    owners = partition([7, 3, 3, 3, 2, 2], 3)
    loads = [sum(s for s, o in zip([7, 3, 3, 3, 2, 2], owners, strict=True) if o == r)
             for r in range(3)]
    assert sorted(loads) == [6, 7, 7]


def finished(events: list[Any]) -> dict[str, Any]:
    return next(e.detail for e in events if isinstance(e, LifecycleEvent)
                and e.phase == "finished")


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "pairs"), [
    # (pp, dp, tp) row-major: the dp pairs are the ranks with the same tp (or pp) coordinate
    ({"dp": 2, "tp": 2}, [(0, 2), (1, 3)]),
    ({"dp": 2, "pp": 2, "microbatches": 2}, [(0, 1), (2, 3)]),
])
def test_zero1_trains_as_replicated_state_and_each_dp_rank_holds_a_share(
        tmp_path: Path, parallel: dict[str, Any], pairs: list[tuple[int, int]]) -> None:
    runs = {strategy: run_ranks(tmp_path / strategy, config(
        tmp_path / strategy, batch=4, ranks=4, parallel={**parallel, "strategy": strategy}), 4)
        for strategy in ("ddp", "zero1")}
    for ddp, zero1 in zip(runs["ddp"], runs["zero1"], strict=True):
        want, got = steps(ddp), steps(zero1)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        for s in want:
            for i in (0, 1):  # loss, grad norm
                assert abs(got[s][i] - want[s][i]) <= SAME_RTOL * abs(want[s][i]), (s, got, want)
    started = next(e.detail for e in runs["zero1"][0] if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started["strategy"] == f"zero1+{'tp' if 'tp' in parallel else 'pp'}"
    held = [finished(events)["optimizer_state_bytes"] for events in runs["zero1"]]
    whole = [finished(events)["optimizer_state_bytes"] for events in runs["ddp"]]
    for a, b in pairs:
        # each parameter's state lives on one rank of the pair: the two shares are the
        # replicated state exactly, split between them about evenly
        assert whole[a] == whole[b] == held[a] + held[b] > 0
        assert max(held[a], held[b]) <= 0.6 * whole[a], (held, whole)


@pytest.mark.slow
def test_a_zero1_checkpoint_resumes_on_another_mesh_and_on_one_rank(tmp_path: Path) -> None:
    whole = one_rank(config(tmp_path / "one", batch=8))
    half = STEPS // 2
    out = tmp_path / "split"
    run_ranks(out, config(out, batch=4, ranks=4, steps=half,
                          parallel={"dp": 2, "tp": 2, "strategy": "zero1"}), 4)
    saved = out / f"dcp_step_{half:08d}"
    assert saved.is_dir()
    # zero1 on pp2 x dp2: a stage's dp pair owns other parameters than dp2 x tp2's did, so
    # each rank reads state its owner on the other mesh wrote
    ranks = run_ranks(out / "pp", config(out, batch=4, ranks=4, parallel={
        "dp": 2, "pp": 2, "microbatches": 2, "strategy": "zero1"}), 4)
    per_rank = [losses(events) for events in ranks]
    assert_follows({s: (per_rank[0][s] + per_rank[1][s]) / 2 for s in per_rank[0]}, whole,
                   half)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / saved.name).symlink_to(saved, target_is_directory=True)
    assert_follows(one_rank(config(alone, batch=8)), whole, half)


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "ranks", "share"), [
    ({}, 4, 1 / 2),  # each parameter sharded over 2 ranks, replicated over the 2 groups
    ({"tp": 2}, 8, 1 / 4),  # and each tp rank's half of it
])
def test_hsdp_shards_within_a_group_and_replicates_across(
        tmp_path: Path, parallel: dict[str, Any], ranks: int, share: float) -> None:
    sink = ListSink()
    train(TrainConfig.model_validate(config(tmp_path / "one", batch=16)), sink)
    whole = steps(sink.events)
    whole_state = finished(sink.events)["optimizer_state_bytes"]
    half = STEPS // 2
    out = tmp_path / "hsdp"
    events = run_ranks(out, config(out, batch=4, ranks=ranks, job={"checkpoint_every": half},
                                   parallel={**parallel, "strategy": "hsdp", "dp_shard": 2}),
                       ranks)
    started = next(e.detail for e in events[0] if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started["strategy"] == ("hsdp+tp" if parallel else "hsdp")
    tp = parallel.get("tp", 1)
    per_rank = [steps(e) for e in events]
    mean = {s: sum(per_rank[d * tp][s][0] for d in range(4)) / 4 for s in whole}
    for s, (loss, norm) in whole.items():
        assert abs(mean[s] - loss) <= FP32_RTOL * loss, (s, mean, whole)
        assert all(abs(r[s][1] - norm) <= FP32_RTOL * norm for r in per_rank)
    for e in events:
        # a share of each parameter's state; measured 1.0002x (1.0044x with tp) of it: every
        # rank keeps AdamW's step counter of every parameter. fsdp over all four would hold a
        # quarter (an eighth), replicas the whole (a half)
        held = finished(e)["optimizer_state_bytes"]
        assert 0.99 <= held / (whole_state * share) <= 1.02, (held, whole_state)
    if parallel:
        return
    alone = tmp_path / "alone"
    alone.mkdir()
    saved = out / f"dcp_step_{half:08d}"
    (alone / saved.name).symlink_to(saved, target_is_directory=True)
    assert_follows(one_rank(config(alone, batch=16)), {s: v[0] for s, v in whole.items()},
                   half)
