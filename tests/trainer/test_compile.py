"""job.compile: the auto rule by a table; compiled and eager jobs give the same losses with
every precision, both attentions, activation checkpointing, adaptive precision's hooks, DDP
and FSDP (real gloo ranks); a compile failure falls back to eager with one warning.

The jobs here compile with dynamo + AOTAutograd and no code generation (``aot_eager``): the
same graphs, hooks, guards and autograd as inductor, without its C++ build, which costs a
minute per cold compile on this 2-core machine. Inductor itself is measured by the lead's
bench and checked on a GPU by bench/gpu_check.py.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import lookup_backend

from traind.contracts.events import LifecycleEvent, PrecisionEvent, StepEvent
from traind.trainer import compile as compile_mod
from traind.trainer.compile import (
    CPU_MIN_JOB_FLOPS,
    CPU_MIN_STEP_FLOPS,
    compile_blocks,
    should_compile,
)
from traind.trainer.config import ModelConfig, TrainConfig
from traind.trainer.loop import train
from traind.trainer.model import GPT, Block, layer_groups
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    MakeConfig = Callable[..., TrainConfig]

# aot_eager runs the same aten ops as eager, but AOTAutograd's decompositions and its
# recompute order round differently in the last bits; over 8 steps of Adam that stays far
# below this (measured: at most ~1e-5), while a block that is skipped, run twice or left
# without gradients moves the loss by more than 1e-2 within two steps.
TOLERANCE = 1e-3
STEPS = 8


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    # Dynamo's caches live on Block.forward's code object for the whole process: the jobs of
    # earlier tests (other models, precisions, backends) would count against each job's
    # recompile limit, which a real job (one model per worker process) never shares.
    torch._dynamo.reset()


@pytest.mark.parametrize(("setting", "device", "steps", "flops", "on", "says"), [
    (True, "cpu", 1, 1.0, True, "job.compile = true"),
    (False, "cuda", 10**6, 1e12, False, "job.compile = false"),
    ("auto", "cuda", 1, 1.0, True, "CUDA"),
    ("auto", "cpu", 10**6, CPU_MIN_STEP_FLOPS / 2, False, "below"),  # the test suite's models
    ("auto", "cpu", 5999, CPU_MIN_JOB_FLOPS / 6000, False, "too few"),
    ("auto", "cpu", 6000, CPU_MIN_JOB_FLOPS / 6000, True, "long CPU job"),
    ("auto", "cpu", 200, 139e9, True, "long CPU job"),  # the bench shape: 200 steps pay
    ("auto", "cpu", 20, 139e9, False, "too few"),
])
def test_should_compile(setting: bool | str, device: str, steps: int, flops: float, on: bool,
                        says: str) -> None:
    got, why = should_compile(setting, device, steps=steps, step_flops=flops)  # type: ignore[arg-type]
    assert got is on and says in why


def test_the_default_job_stays_eager_on_the_cpu() -> None:
    # the default model at the default 2000 steps: a cold compile would only break even
    cfg = TrainConfig()
    flops = GPT(cfg.model).flops_per_token() * cfg.job.batch_size * cfg.model.seq_len
    assert flops >= CPU_MIN_STEP_FLOPS  # its steps are large enough ...
    assert should_compile(cfg.job.compile, "cpu", steps=cfg.job.steps,
                          step_flops=flops)[0] is False  # ... the job is too short
    assert should_compile(cfg.job.compile, "cpu", steps=10 * cfg.job.steps,
                          step_flops=flops)[0] is True


def test_the_default_job_of_the_test_suite_stays_eager(make_config: MakeConfig) -> None:
    cfg = make_config(None, steps=100_000)
    model = GPT(cfg.model)
    flops = model.flops_per_token() * cfg.job.batch_size * cfg.model.seq_len
    assert cfg.job.compile == "auto"
    assert should_compile("auto", "cpu", steps=100_000, step_flops=flops)[0] is False


# -- compile_blocks on a model ---------------------------------------------------------------

TINY = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=32)


class Counter:
    """A backend that counts the graphs it compiles and runs them through aot_eager."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return lookup_backend("aot_eager")(gm, example_inputs)


def test_the_module_tree_is_untouched_and_one_graph_serves_every_block() -> None:
    torch.manual_seed(0)
    eager, model = GPT(TINY), GPT(TINY)
    model.load_state_dict(eager.state_dict())
    keys = list(model.state_dict())
    counter = Counter()
    state = compile_blocks(model, backend=counter)
    # what fully_shard, layer_groups and checkpoints see is what they saw before
    assert all(type(b) is Block for b in model.blocks) and list(model.state_dict()) == keys
    assert list(layer_groups(model)) == ["embed", "block.0", "block.1", "block.2", "head"]
    x = torch.randint(0, 256, (2, 32))
    _, loss = model(x, x)
    _, ref = eager(x, x)
    assert loss is not None and ref is not None
    loss.backward()
    ref.backward()
    assert counter.graphs == 1 and state.active  # three blocks, one compile
    torch.testing.assert_close(loss, ref)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    state.remove()
    assert all("forward" not in vars(b) for b in model.blocks)


class _Picky(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 4:
            raise ValueError("picky: wants 4 features")
        return x * 2


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Picky()])


def test_an_error_of_the_block_itself_propagates_and_is_not_a_compile_failure() -> None:
    stack = _Stack()
    state = compile_blocks(stack, backend="aot_eager")
    with pytest.raises(ValueError, match="picky"):
        stack.blocks[0](torch.ones(3))
    assert state.active
    torch.testing.assert_close(stack.blocks[0](torch.ones(4)), torch.full((4,), 2.0))


def test_a_model_without_blocks_is_refused() -> None:
    with pytest.raises(TypeError, match=r"job.compile needs a model with \.blocks"):
        compile_blocks(nn.Linear(2, 2))


# -- whole jobs: compiled against eager --------------------------------------------------------


def _job(make_config: MakeConfig, tmp: Path, *, compile_: bool, model: dict[str, Any],
         precision: str) -> TrainConfig:
    cfg = make_config(tmp, steps=STEPS, eval_every=STEPS, checkpoint_every=1000,
                      compile=compile_)
    return TrainConfig.model_validate({
        **cfg.model_dump(), "model": {**cfg.model.model_dump(), **model},
        "precision": {"mode": precision, "snr_window": 2, "snr_low": 1e-4, "snr_high": 1e-3,
                      "min_dwell": 0}})


def _losses(sink: ListSink) -> dict[int, float]:
    return {e.step: e.loss for e in sink.events if isinstance(e, StepEvent)}


def _started(sink: ListSink) -> dict[str, Any]:
    started = next(e for e in sink.events if isinstance(e, LifecycleEvent))
    return started.detail


@pytest.mark.parametrize(("precision", "model"), [
    ("fp32", {"activation_offload": True}),  # saved tensors parked by save_on_cpu hooks
    ("bf16", {"attention": "sliding_window", "window": 8}),
    ("fp16", {"activation_checkpointing": True}),
    # adaptive's autocast hooks on each block: they run eagerly around the compiled forward
    # (window 2, no dwell: its blocks switch to bf16 within the run)
    ("adaptive", {}),
    ("fp8", {"activation_checkpointing": True}),  # torchao's Float8Linear inside the graph
])
def test_compiled_job_matches_eager(tmp_path: Path, make_config: MakeConfig,
                                    monkeypatch: pytest.MonkeyPatch, precision: str,
                                    model: dict[str, Any]) -> None:
    counter = Counter()
    monkeypatch.setattr(compile_mod, "BACKEND", counter)
    runs = {}
    for on in (False, True):
        sink = ListSink()
        train(_job(make_config, tmp_path / str(on), compile_=on, model=model,
                   precision=precision), sink)
        runs[on] = _losses(sink)
        assert _started(sink)["compile"].startswith("on" if on else "off")
        assert not any(isinstance(e, LifecycleEvent) and e.phase == "compile_fallback"
                       for e in sink.events)
        if precision == "adaptive":  # its blocks did switch (the autocast guards matter)
            assert any(isinstance(e, PrecisionEvent) and e.after == "bf16"
                       for e in sink.events)
    assert counter.graphs >= 2  # training and evaluation (no_grad) graphs: it did compile
    assert sorted(runs[True]) == list(range(1, STEPS + 1))
    for step, loss in runs[False].items():
        assert abs(runs[True][step] - loss) < TOLERANCE, (step, runs)


def _raise(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("injected: this backend cannot compile anything")


def _raise_in_backward(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("injected: no backward for you")


@pytest.mark.parametrize(("backend", "says"), [
    (_raise, "cannot compile anything"),
    # the forward compiles; the backward graph fails. Compiled lazily (torch's default) it
    # would fail inside loss.backward(), out of reach; compile_blocks compiles it with the
    # forward, where the fallback catches it.
    (aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=_raise_in_backward),
     "no backward for you"),
])
def test_a_compile_failure_falls_back_to_eager_with_one_warning(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, backend: Any, says: str) -> None:
    monkeypatch.setattr(compile_mod, "BACKEND", backend)
    eager, sink = ListSink(), ListSink()
    train(_job(make_config, tmp_path / "eager", compile_=False, model={}, precision="fp32"),
          eager)
    with caplog.at_level(logging.WARNING, logger="traind"):
        result = train(_job(make_config, tmp_path / "compiled", compile_=True, model={},
                            precision="fp32"), sink)
    assert result.step == STEPS  # the job went on
    warnings = [r for r in caplog.records if "job.compile" in r.getMessage()]
    assert len(warnings) == 1 and says in warnings[0].getMessage(), warnings
    fallbacks = [e for e in sink.events
                 if isinstance(e, LifecycleEvent) and e.phase == "compile_fallback"]
    assert len(fallbacks) == 1 and says in fallbacks[0].detail["reason"]
    assert _losses(sink) == pytest.approx(_losses(eager), abs=1e-6)  # eager from step 1 on


# -- two gloo ranks: DDP and FSDP --------------------------------------------------------------

WORLD = 2


def _rank_main(rank: int, store: str, cfg: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    compile_mod.BACKEND = "aot_eager"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    sink = ListSink()
    train(TrainConfig.model_validate(cfg), sink)
    fallbacks = [e for e in sink.events
                 if isinstance(e, LifecycleEvent) and e.phase == "compile_fallback"]
    torch.save({"losses": _losses(sink), "started": _started(sink),
                "fallbacks": len(fallbacks)}, f"{out}.{rank}")
    # Leave without freeing the DDP reducer or the group (a reducer freed under a live gloo
    # group can deadlock at exit; trainer/loop.py's _KEEP_UNTIL_EXIT has the story).
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_compiled_ranks_match_one_eager_rank(tmp_path: Path, make_config: MakeConfig,
                                                 strategy: str) -> None:
    """2 compiled ranks of batch B against one eager process of 2B: the same data and math,
    different reduction order (test_parallel.py's tolerance)."""
    base = _job(make_config, tmp_path / "one", compile_=False, model={}, precision="fp32")
    one = ListSink()
    train(TrainConfig.model_validate({**base.model_dump(),
                                      "job": {**base.job.model_dump(), "batch_size": 8}}), one)
    cfg = base.model_dump(mode="json")
    cfg["job"].update(compile=True, batch_size=4, out_dir=str(tmp_path / "two"),
                      nproc_per_node=WORLD)
    cfg["parallel"]["strategy"] = strategy
    out = tmp_path / "rank.pt"
    mp.start_processes(_rank_main, args=(str(tmp_path / "store"), cfg, str(out)),
                       nprocs=WORLD, start_method="fork")
    ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for rank in ranks:
        assert rank["started"]["compile"].startswith("on")
        assert rank["started"]["strategy"] == strategy and rank["fallbacks"] == 0
    for step, loss in _losses(one).items():
        mean = sum(r["losses"][step] for r in ranks) / WORLD  # each rank's loss is its half's
        assert abs(mean - loss) < 2e-3, (step, mean, loss)
