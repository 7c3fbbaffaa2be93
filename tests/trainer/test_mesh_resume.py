"""A checkpoint written on one mesh resumes on another (issue 16): saved on dp2 x tp2 (four
ranks, FSDP2 over dp, DTensor shards over tp), resumed on pp2 x dp2 (four ranks, each stage
its own slice of the blocks) and on one rank; each follows the uninterrupted one-rank run of
the whole batch. torch.distributed.checkpoint reshards: the keys are the full model's
parameter names on every mesh (a stage keeps them, trainer/pipeline_parallel.py), and the
optimizer's state is keyed by them too (Strategy.flatten_optimizer_state says why)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.trainer.mesh_runs import STEPS, config, run_ranks
from traind.contracts.events import StepEvent
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
# fp32, relative per step: the reordered sums of test_tensor_parallel and
# test_pipeline_parallel (measured ~1e-7 there), carried across the resume
FP32_RTOL = 1e-5


def losses(events: list[Any]) -> dict[int, float]:
    return {e.step: e.loss for e in events if isinstance(e, StepEvent)}


def one_rank(cfg: dict[str, Any]) -> dict[int, float]:
    sink = ListSink()
    train(TrainConfig.model_validate(cfg), sink)
    return losses(sink.events)


def assert_follows(got: dict[int, float], whole: dict[int, float], after: int) -> None:
    assert sorted(got) == list(range(after + 1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - whole[step]) <= FP32_RTOL * abs(whole[step]), (step, loss, whole)


def test_dp2_tp2_resumes_on_pp2_dp2_and_on_one_rank(tmp_path: Path) -> None:
    whole = one_rank(config(tmp_path / "one", batch=8))
    half = STEPS // 2
    out = tmp_path / "split"
    run_ranks(out, config(out, batch=4, ranks=4, steps=half,
                          parallel={"tp": 2, "strategy": "fsdp"}), 4)
    saved = out / f"dcp_step_{half:08d}"
    assert saved.is_dir()
    # pp2 x dp2: the dp ranks of a stage read halves of the batch, as the dp2 x tp2 ones did
    ranks = run_ranks(out / "pp", config(out, batch=4, ranks=4,
                                         parallel={"pp": 2, "microbatches": 2}), 4)
    per_rank = [losses(events) for events in ranks]
    mean = {s: (per_rank[0][s] + per_rank[1][s]) / 2 for s in per_rank[0]}
    assert_follows(mean, whole, half)
    # one rank, the whole batch, from the same folder: the pp run wrote a newer checkpoint
    # (its end), so resume from a copy of the dp2 x tp2 one alone
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / saved.name).symlink_to(saved, target_is_directory=True)
    assert_follows(one_rank(config(alone, batch=8)), whole, half)
