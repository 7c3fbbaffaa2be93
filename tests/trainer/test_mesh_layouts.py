"""Tensor and pipeline parallel together on real gloo ranks under torchrun: tp2 x pp2 (four
ranks) and dp2 x tp2 x pp2 (eight), each stage's blocks DTensor-parallel over its tp pair,
follow the one-rank run of the whole batch step by step, losses and grad norms (the norm
summed over the stages, each stage's over its tp shards and dp shards).

Why not bitwise: the reordered float32 sums of test_tensor_parallel and
test_pipeline_parallel, together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.trainer.mesh_runs import STEPS, config, run_ranks
from traind.contracts.events import CommEvent, LifecycleEvent, PipelineEvent, StepEvent
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
# fp32, relative per step; measured at worst 1.1e-7 (losses) and 3.7e-7 (grad norms)
FP32_RTOL = 1e-5


def steps(events: list[Any]) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) per step."""
    return {e.step: (e.loss, e.grad_norm) for e in events if isinstance(e, StepEvent)}


def one_rank(cfg: dict[str, Any]) -> dict[int, tuple[float, float]]:
    sink = ListSink()
    train(TrainConfig.model_validate(cfg), sink)
    return steps(sink.events)


def worst(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]],
          i: int) -> float:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    return max(abs(got[s][i] - want[s][i]) / abs(want[s][i]) for s in want)


@pytest.mark.parametrize(("parallel", "ranks"), [
    ({"tp": 2, "pp": 2, "microbatches": 2}, 4),
    ({"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "strategy": "fsdp"}, 8),
])
def test_tp_and_pp_follow_one_rank_of_the_whole_batch(tmp_path: Path, parallel: dict[str, Any],
                                                       ranks: int) -> None:
    dp = parallel.get("dp", 1)
    reference = one_rank(config(tmp_path / "one", batch=4 * dp))
    events = run_ranks(tmp_path / "mesh", config(tmp_path / "mesh", batch=4, ranks=ranks,
                                                 parallel=parallel), ranks)
    started = next(e for e in events[0] if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started.detail["mesh"] == {"dp": dp, "tp": 2, "pp": 2}
    per_rank = [steps(e) for e in events]
    # rank = (pp * dp + dp_index) * tp + tp_index: a dp group's ranks (both stages, both tp
    # shards) report one loss and one norm
    groups = [[per_rank[(pp * dp + d) * 2 + t] for pp in range(2) for t in range(2)]
              for d in range(dp)]
    for group in groups:
        assert all(r == group[0] for r in group)
    mean = {s: (sum(g[0][s][0] for g in groups) / dp, groups[0][0][s][1]) for s in reference}
    assert worst(mean, reference, 0) <= FP32_RTOL
    # dp averages the gradients before the norm: every group's norm is the whole batch's
    assert worst(mean, reference, 1) <= FP32_RTOL
    if dp == 1:  # one 3D job's communication, both dimensions (the 8-rank one is as 4)
        assert_tp_and_pp_traffic(events)


def assert_tp_and_pp_traffic(events: list[list[Any]]) -> None:
    """tp2 x pp2: each rank's DTensor collectives (counted at the last step: telemetry.
    layer_every is 10) are mesh_dim tp, and what crosses a stage boundary is a tp rank's
    sequence shard: (B / m, T / tp, C) float32 = 2 x 16 x 32 x 4 bytes per micro-batch."""
    shard = 4 // 2 * (32 // 2) * 32 * 4
    for rank, evs in enumerate(events):
        comm = [e for e in evs if isinstance(e, CommEvent)]
        assert [(e.mesh_dim, e.step, e.steps) for e in comm] == [("tp", STEPS, STEPS)]
        assert {"all_gather", "reduce_scatter"} <= {c["op"] for c in comm[0].collectives}
        pipe = [e for e in evs if isinstance(e, PipelineEvent)]
        sent = {(p["direction"], p["op"]): (p["calls"], p["bytes"]) for p in pipe[-1].p2p}
        stage = rank // 2  # (pp, dp, tp) row-major: ranks 0, 1 are stage 0
        assert sent == ({("forward", "send"): (2, 2 * shard), ("backward", "recv"): (2, 2 * shard)}
                        if stage == 0 else
                        {("forward", "recv"): (2, 2 * shard), ("backward", "send"): (2, 2 * shard)})
