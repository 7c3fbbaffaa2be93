"""The daemon checks compression with the trainer's rule (trainer/config.py), so it refuses
before a launch exactly what the trainer would refuse after one."""

from __future__ import annotations

import pytest

from traind.daemon.autotune.search import Candidate, Hardware, infeasible
from traind.daemon.config import ConfigError
from traind.daemon.experiments.specs import arm_config
from traind.trainer.config import TrainConfig

INT8 = {"name": "int8", "compression": {"method": "int8"}}


def _base(nproc: int, strategy: str, single_rank_group: bool = False) -> TrainConfig:
    return TrainConfig.model_validate({
        "job": {"nproc_per_node": nproc},
        "parallel": {"strategy": strategy, "single_rank_group": single_rank_group}})


def test_a_forked_arm_is_refused_with_the_field_and_what_to_change() -> None:
    with pytest.raises(ConfigError) as one_rank:
        arm_config(_base(1, "ddp"), INT8, index=1)
    assert str(one_rank.value) == (
        "arms.1.compression.method: 'int8' compresses DDP's gradient all-reduce, so it needs "
        "DDP: more than one rank (job.nproc_per_node x job.nnodes = 1)")
    with pytest.raises(ConfigError, match=r"^arms.1.compression.method: .*\(not 'fsdp'\)$"):
        arm_config(_base(2, "fsdp"), INT8, index=1)
    assert arm_config(_base(2, "zero1"), INT8, index=1).compression.method == "int8"


def test_one_rank_in_a_group_of_its_own_is_not_refused() -> None:
    """The trainer wraps one rank in DDP under parallel.single_rank_group and runs its
    compression hook; the daemon refused such an arm before it shared the trainer's rule."""
    cfg = arm_config(_base(1, "ddp", single_rank_group=True), INT8, index=1)
    assert cfg.compression.method == "int8"


def test_the_tuner_leaves_out_what_the_rule_refuses() -> None:
    c = Candidate("fp32", {"method": "int8"})
    assert infeasible(c, Hardware(device="cpu", ranks=2, strategy="ddp")) is None
    why = infeasible(c, Hardware(device="cpu", ranks=2, strategy="fsdp"))
    assert why == ("compression 'int8' compresses DDP's gradient all-reduce, so it needs DDP: "
                   "parallel.strategy ddp or zero1 (not 'fsdp')")
