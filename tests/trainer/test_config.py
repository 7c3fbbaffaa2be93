"""The trainer config's shared rules and lists (trainer/config.py)."""

from __future__ import annotations

import pytest
import torch

from traind.trainer.compression import METHODS
from traind.trainer.config import (
    COMPRESSION_METHODS,
    PRECISION_MODES,
    SWITCHABLE_PRECISIONS,
    ArmConfig,
    ParallelConfig,
    PrecisionConfig,
    compression_unavailable,
)
from traind.trainer.distributed import DistInfo
from traind.trainer.parallel import build_strategy


@pytest.mark.parametrize(("method", "strategy", "ranks", "needs"), [
    ("none", "ddp", 1, None),  # a plain all-reduce: any job
    ("none", "fsdp", 1, None),
    ("int8", "ddp", 2, None),
    ("powersgd", "zero1", 4, None),
    ("int8", "ddp", 1, ["more than one rank (job.nproc_per_node x job.nnodes = 1)"]),
    ("topk", "zero1", 1, ["more than one rank (job.nproc_per_node x job.nnodes = 1)"]),
    ("int8", "fsdp", 2, ["parallel.strategy ddp or zero1 (not 'fsdp')"]),
    ("int8", "hsdp", 4, ["parallel.strategy ddp or zero1 (not 'hsdp')"]),
    ("bf16", "fsdp", 1, ["more than one rank (job.nproc_per_node x job.nnodes = 1)",
                         "parallel.strategy ddp or zero1 (not 'fsdp')"]),
])
def test_compression_needs_ddp_and_the_reason_names_the_field(
        method: str, strategy: str, ranks: int, needs: list[str] | None) -> None:
    why = compression_unavailable(method, strategy=strategy, ranks=ranks)
    if needs is None:
        assert why is None
        return
    assert why == (f"{method!r} compresses DDP's gradient all-reduce, so it needs DDP: "
                   + " and ".join(needs))


def test_one_rank_in_a_group_of_its_own_runs_compression() -> None:
    assert compression_unavailable("int8", strategy="ddp", ranks=1,
                                   single_rank_group=True) is None
    why = compression_unavailable("int8", strategy="fsdp", ranks=1, single_rank_group=True)
    assert why is not None and "more than one rank" not in why and "(not 'fsdp')" in why


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("single_rank_group", [False, True])
def test_the_rule_holds_exactly_where_the_trainer_wraps_in_ddp(
        strategy: str, ranks: int, single_rank_group: bool) -> None:
    """The loop installs the compression hook where its strategy is DDP and refuses a method
    where the rule says no: the two must agree, or a method would silently not run."""
    cfg = ParallelConfig(strategy=strategy, single_rank_group=single_rank_group)  # type: ignore[arg-type]
    info = DistInfo(rank=0, local_rank=0, world_size=ranks, device=torch.device("cpu"),
                    owns_group=False)
    can = compression_unavailable("int8", strategy=strategy, ranks=ranks,
                                  single_rank_group=single_rank_group) is None
    assert build_strategy(cfg, info).ddp == can


def test_the_lists_are_the_config_types_and_the_registry() -> None:
    assert set(COMPRESSION_METHODS) == set(METHODS)  # a class for every method a config names
    assert set(SWITCHABLE_PRECISIONS) <= set(PRECISION_MODES)
    assert PrecisionConfig.model_fields["mode"].annotation.__args__ == PRECISION_MODES  # type: ignore[union-attr]
    for mode in SWITCHABLE_PRECISIONS:
        assert ArmConfig(name="a", precision=mode).precision == mode  # type: ignore[arg-type]


def test_every_integer_setting_has_an_upper_bound() -> None:
    """Issue 40: model.seq_len=9223372036854775807 was accepted and failed in the worker
    (IntArrayRef ... SymInt). Every int in the config tree, the daemon's too, is bounded
    where it is declared, so a slipped digit is a ConfigError naming the field."""
    import types
    import typing

    import annotated_types
    from pydantic import BaseModel

    from traind.daemon.config import Settings

    def ints(annotation: object) -> bool:
        args = typing.get_args(annotation)
        return annotation is int or (typing.get_origin(annotation) in (
            typing.Union, types.UnionType) and int in args)

    seen, unbounded, todo, done = 0, [], [Settings], set()
    while todo:
        model = todo.pop()
        if model in done:
            continue
        done.add(model)
        for name, field in model.model_fields.items():
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
            if ints(field.annotation):
                seen += 1
                if not any(isinstance(m, annotated_types.Le | annotated_types.Lt)
                           for m in field.metadata):
                    unbounded.append(f"{model.__name__}.{name}")
    assert seen > 40, seen
    assert not unbounded, unbounded
