from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import pytest

from traind.contracts.events import ArmEvent
from traind.trainer.config import InterleaveConfig, TrainConfig
from traind.trainer.interleave import Schedule, arm_index
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize(
    ("n_arms", "expected"),
    [
        (2, [0, 1, 1, 0, 0, 1, 1, 0]),  # A B B A A B B A
        (3, [0, 1, 2, 2, 1, 0, 0, 1, 2]),  # A B C C B A A B C
    ],
)
def test_balanced_order(n_arms: int, expected: list[int]) -> None:
    assert [arm_index(b, n_arms) for b in range(len(expected))] == expected


def test_schedule_measures_blocks_after_warmup() -> None:
    cfg = InterleaveConfig.model_validate({"arms": [{"name": "A"}, {"name": "B"}],
                                           "block_steps": 4, "warmup_steps": 1})
    sched = Schedule(cfg)
    results = []
    for step in range(1, 9):
        _, starts = sched.arm_for(step)
        assert starts == (step in (1, 5))
        r = sched.record(step, seconds=0.1 * step, tokens=10, loss=float(step))
        if r:
            results.append(r)
    a, b = results
    assert (a.arm, a.block, a.step, a.steps, a.tokens) == ("A", 0, 4, 3, 30)
    assert a.seconds == pytest.approx(0.2 + 0.3 + 0.4) and a.loss == pytest.approx(2.5)
    assert (b.arm, b.block, b.steps) == ("B", 1, 3)


@pytest.mark.parametrize(
    ("interleave", "error"),
    [
        ({"arms": [{"name": "A"}]}, "two or more"),
        ({"arms": [{"name": "A"}, {"name": "A"}]}, "unique"),
        ({"arms": [{"name": "A"}, {"name": "B"}], "block_steps": 3, "warmup_steps": 3},
         "warmup_steps must be below block_steps"),
        ({"arms": [{"name": "A"}, {"name": "B", "compression": {"method": "int9"}}]},
         "interleave.arms.1.compression"),
    ],
)
def test_bad_arms_are_rejected(interleave: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TrainConfig.model_validate({"interleave": interleave})


def test_precision_arms_alternate_inside_one_job(tmp_path: Path, make_config: Any) -> None:
    cfg = make_config(tmp_path, steps=24)
    cfg = TrainConfig.model_validate({**cfg.model_dump(), "interleave": {
        "arms": [{"name": "fp32", "precision": "fp32"}, {"name": "bf16", "precision": "bf16"}],
        "block_steps": 6, "warmup_steps": 1}})
    sink = ListSink()
    train(cfg, sink)
    blocks = [e for e in sink.events if isinstance(e, ArmEvent)]
    assert [(b.arm, b.block, b.step) for b in blocks] == [
        ("fp32", 0, 6), ("bf16", 1, 12), ("bf16", 2, 18), ("fp32", 3, 24)]
    assert all(b.steps == 5 and b.tokens == 5 * 4 * 32 and b.seconds > 0 for b in blocks)
    assert all(not math.isnan(b.loss) for b in blocks)


def test_compression_arms_need_ddp(tmp_path: Path, make_config: Any) -> None:
    cfg = make_config(tmp_path, steps=4)
    arms = {"block_steps": 2, "warmup_steps": 0}
    bad = TrainConfig.model_validate({**cfg.model_dump(), "interleave": {
        "arms": [{"name": "A"}, {"name": "B", "compression": {"method": "int8"}}], **arms}})
    with pytest.raises(ValueError, match="compression arms need DDP"):
        train(bad, ListSink())
    # "none" on every arm (what the experiment form sends) needs no DDP: it trains.
    cfg = TrainConfig.model_validate({**cfg.model_dump(), "interleave": {
        "arms": [{"name": "A", "compression": {"method": "none"}},
                 {"name": "B", "compression": {"method": "none"}, "precision": "bf16"}],
        **arms}})
    assert train(cfg, ListSink()).step == 4


def test_a_planted_slowdown_is_inside_the_blocks_time(tmp_path: Path, make_config: Any) -> None:
    """ArmConfig.slowdown (bench/ab_calibration.py's known effect): an arm that sleeps half
    of each step's compute time measures ~1.5x the seconds per step of an identical arm."""
    cfg = make_config(tmp_path, steps=40, checkpoint_every=1000, eval_every=1000)
    cfg = TrainConfig.model_validate({**cfg.model_dump(), "interleave": {
        "arms": [{"name": "a"}, {"name": "b", "slowdown": 0.5}],
        "block_steps": 5, "warmup_steps": 1}})
    sink = ListSink()
    train(cfg, sink)
    blocks = [e for e in sink.events if isinstance(e, ArmEvent)]
    per_step = {arm: sum(b.seconds for b in blocks if b.arm == arm)
                / sum(b.steps for b in blocks if b.arm == arm) for arm in ("a", "b")}
    assert per_step["b"] / per_step["a"] > 1.2, per_step


def test_slowdown_is_a_fraction() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        TrainConfig.model_validate({"interleave": {
            "arms": [{"name": "a"}, {"name": "b", "slowdown": 1.5}]}})
