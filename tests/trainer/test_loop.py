from __future__ import annotations

import math
import shutil
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from traind.contracts.events import (
    CommEvent,
    EvalEvent,
    LifecycleEvent,
    PrecisionEvent,
    SNREvent,
    StepEvent,
)
from traind.trainer import loop
from traind.trainer.checkpoint import latest, list_checkpoints, load_checkpoint
from traind.trainer.config import TrainConfig
from traind.trainer.device import peak_memory
from traind.trainer.loop import train
from traind.trainer.model import layer_groups
from traind.trainer.precision import POLICIES
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path

MakeConfig = Callable[..., TrainConfig]


def _losses(sink: ListSink) -> dict[int, float]:
    return {e.step: e.loss for e in sink.events if isinstance(e, StepEvent)}


def test_loss_falls_and_events_arrive(tmp_path: Path, make_config: MakeConfig) -> None:
    sink = ListSink()
    result = train(make_config(tmp_path), sink)
    losses = _losses(sink)
    assert sorted(losses) == list(range(1, 61))
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(56, 61)) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(256) = 5.5 to well under 4.5
    assert result.step == 60 and not result.stopped and result.tokens == 60 * 4 * 32
    assert result.loss == losses[60] and result.tokens_per_second > 0

    phases = [e.phase for e in sink.events if isinstance(e, LifecycleEvent)]
    assert phases == ["started", "checkpoint", "checkpoint", "checkpoint", "finished"]
    started = sink.events[0]
    assert isinstance(started, LifecycleEvent) and started.phase == "started"
    assert started.detail["world_size"] == 1 and started.detail["total_steps"] == 60
    assert started.detail["params"] > 0 and started.detail["flops_per_token"] > 0
    assert started.detail["tokens_per_step"] == 4 * 32 and started.detail["device"] == "cpu"
    evals = [e for e in sink.events if isinstance(e, EvalEvent)]
    assert [e.step for e in evals] == [20, 40, 60] and result.val_loss == evals[-1].val_loss
    assert isinstance(sink.events[-1], LifecycleEvent) and sink.events[-1].phase == "finished"
    step = next(e for e in sink.events if isinstance(e, StepEvent))
    assert step.tokens == 128 and step.step_seconds >= step.forward_seconds > 0
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000020.pt", "step_00000040.pt", "step_00000060.pt"]


def test_resume_gives_the_same_losses(tmp_path: Path, make_config: MakeConfig) -> None:
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = ListSink()
    train(make_config(full_dir, steps=40), full)
    resumed_dir.mkdir()
    shutil.copy(full_dir / "step_00000020.pt", resumed_dir)

    sink = ListSink()
    result = train(make_config(resumed_dir, steps=40), sink)
    assert result.resumed_from == 20 and result.step == 40
    phases = [(e.phase, e.step) for e in sink.events if isinstance(e, LifecycleEvent)]
    assert phases[:2] == [("started", 20), ("resumed", 20)]
    expected = {s: v for s, v in _losses(full).items() if s > 20}
    got = _losses(sink)
    assert sorted(got) == list(range(21, 41))
    for s in range(21, 41):
        assert got[s] == pytest.approx(expected[s], abs=1e-6), s
    val_full = [e.val_loss for e in full.events if isinstance(e, EvalEvent)][-1]
    assert result.val_loss == pytest.approx(val_full, abs=1e-6)


def test_stop_checkpoints_and_returns_early(tmp_path: Path, make_config: MakeConfig) -> None:
    stop = threading.Event()
    stop.set()
    sink = ListSink()
    result = train(make_config(tmp_path, steps=1000), sink, stop=stop)
    assert result.stopped and result.step == 1
    path = latest(tmp_path)
    assert path is not None and load_checkpoint(path)["step"] == 1
    finished = sink.events[-1]
    assert isinstance(finished, LifecycleEvent) and finished.phase == "finished"
    assert finished.detail["stopped"] is True
    # the rank's peak memory: the process's resident set on CPU (a GPU adds its allocator's)
    assert set(finished.detail["peak_memory"]) == {"host_rss"}
    assert finished.detail["peak_memory"]["host_rss"] > 100 * 2**20  # torch alone is more


def test_a_gpu_rank_reports_its_allocator_peak_too() -> None:
    class FakeCuda:
        @staticmethod
        def max_memory_allocated(device: torch.device) -> int:
            assert device == torch.device("cuda", 1)
            return 3 * 2**30

    peak = peak_memory(torch.device("cuda", 1), cuda=FakeCuda)
    assert peak["device_allocated"] == 3 * 2**30 and peak["host_rss"] > 0


# -- what the training step really computes in, per precision policy ---------------------------

# The ops whose input dtypes say what a layer computes in: the matmuls (a Linear is mm or addmm
# by the time it reaches the dispatcher, autocast's casts already made), attention's SDPA,
# and the embedding's lookup (the one op of the "embed" group).
_COMPUTE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_scaled_mm",
                          "embedding"})


@dataclass(frozen=True)
class _Compute:
    step: int  # the training forward it ran in (1-based; an evaluation's are not recorded)
    group: str  # layer_groups' name of the module: "embed", "block.0", ..., "head"
    module: str  # the innermost module running it ("blocks.0.attn.q")
    op: str  # aten op name ("mm", "_scaled_dot_product_flash_attention_for_cpu", ...)
    dtypes: tuple[str, ...]  # its tensor inputs' ("bfloat16"); fp8: the data's ("float8_e4m3fn")


def _dtype(t: torch.Tensor) -> str:
    """What ``t`` computes with: torchao's fp8 tensors report the dtype they stand for (their
    ``dtype`` is the high precision's); their data is fp8."""
    fp8 = sys.modules.get("torchao.float8.float8_training_tensor")
    if fp8 is not None and isinstance(t, fp8.Float8TrainingTensor):
        return str(t._data.dtype).removeprefix("torch.")
    return str(t.dtype).removeprefix("torch.")


class _ComputeLog(TorchDispatchMode):
    """Every matmul, attention and embedding op of the training forwards, with the dtypes it
    saw after autocast and the module it ran in. Hooks on every module of the model the loop
    built (through build_stack) keep the module stack; the dispatch mode sees the ops."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Compute] = []
        self.step = 0
        self._training = False  # the forward under way is a training one
        self._where: list[tuple[str, str]] = []  # (group, module name), innermost last

    def watch(self, model: nn.Module) -> None:
        group_of = {id(sub): group for group, modules in layer_groups(model).items()
                    for module in modules for sub in module.modules()}

        def count_step(module: nn.Module, args: object) -> None:
            self._training = module.training
            self.step += module.training

        def enter(name: str) -> Callable[[nn.Module, object], None]:
            def hook(module: nn.Module, args: object) -> None:
                self._where.append((group_of.get(id(module), ""), name))
            return hook

        def leave(module: nn.Module, args: object, out: object) -> None:
            self._where.pop()

        model.register_forward_pre_hook(count_step)
        for name, module in model.named_modules():
            module.register_forward_pre_hook(enter(name))
            module.register_forward_hook(leave, always_call=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        op = func.overloadpacket.__name__
        if self._training and self._where and (
                op in _COMPUTE_OPS or "scaled_dot_product" in op):
            group, module = self._where[-1]
            self.calls.append(_Compute(self.step, group, module, op, tuple(
                _dtype(a) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _compute_log(cfg: TrainConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[_ComputeLog,
                                                                              ListSink]:
    """Run the real loop on ``cfg`` and log what its training forwards compute in."""
    log = _ComputeLog()
    real = loop.build_stack

    def build_stack(*args: Any, **kwargs: Any) -> Any:
        stack = real(*args, **kwargs)
        log.watch(stack.model)
        return stack

    monkeypatch.setattr(loop, "build_stack", build_stack)
    sink = ListSink()
    with log:
        train(cfg, sink)
    return log, sink


_LINEARS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.gate", "mlp.up", "mlp.down")


def _seen(calls: list[_Compute], *, steps: set[int] | None = None,
          attention: bool = False) -> dict[str, set[str]]:
    """Per module, the dtypes its matmuls read (``attention``: its SDPA's) in ``steps``."""
    seen: dict[str, set[str]] = {}
    for c in calls:
        if (steps is None or c.step in steps) and c.op != "embedding" and attention == (
                "scaled_dot_product" in c.op):
            seen.setdefault(c.module, set()).update(c.dtypes)
    return seen


@pytest.mark.parametrize(("mode", "extra", "linears", "head"), [
    ("fp32", {}, "float32", "float32"),
    ("bf16", {}, "bfloat16", "bfloat16"),
    ("fp16", {}, "float16", "float16"),
    # torchao's Float8Linear (emulated here): both operands of each block matmul are fp8 data;
    # never the head (fp8_converts), which computes under fp8's bf16 autocast
    ("fp8", {"fp8_recipe": "tensorwise"}, "float8_e4m3fn", "bfloat16"),
    ("fp8", {"fp8_recipe": "rowwise"}, "float8_e4m3fn", "bfloat16"),
], ids=["fp32", "bf16", "fp16", "fp8-tensorwise", "fp8-rowwise"])
def test_each_policy_computes_the_blocks_in_its_precision(
        make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, mode: str,
        extra: dict[str, str], linears: str, head: str) -> None:
    """What the loop's own training step computes in, op by op: every Linear of every block,
    the blocks' attention, the head and the embedding lookup."""
    cfg = make_config(steps=2)
    cfg = cfg.model_copy(update={"precision": cfg.precision.model_validate(
        {"mode": mode, **extra})})
    log, _ = _compute_log(cfg, monkeypatch)
    assert {c.step for c in log.calls} == {1, 2}
    blocks = {f"blocks.{i}.{name}" for i in range(2) for name in _LINEARS}
    # one matmul per Linear per step: nothing computed outside the layers watched
    per_step = Counter((c.step, c.module) for c in log.calls
                       if c.op != "embedding" and "scaled_dot_product" not in c.op)
    assert per_step == {(s, m): 1 for s in (1, 2) for m in (*blocks, "head")}
    seen = _seen(log.calls)
    assert {m: seen[m] for m in blocks} == {m: {linears} for m in blocks}
    assert seen["head"] == {head}
    # attention runs in the dtype the policy declares for a block's compute
    compute = str(POLICIES[mode].compute_dtype).removeprefix("torch.")
    assert _seen(log.calls, attention=True) == {f"blocks.{i}.attn": {compute} for i in range(2)}
    # the embedding is a lookup into the fp32 table whatever the mode (no autocast op casts it)
    lookups = {c.dtypes for c in log.calls if c.op == "embedding"}
    assert lookups == {("float32", "int64")} and {
        c.group for c in log.calls if c.op == "embedding"} == {"embed"}


@pytest.mark.parametrize(("low", "split"), [("bf16", "gap"), ("fp16", "gap"), ("bf16", "all")])
def test_adaptive_computes_each_group_in_the_precision_it_switched_to(
        make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, low: str, split: str) -> None:
    """A group that switched computes in ``low`` from the next step, one kept in fp32 computes
    fp32 beside it, the embedding stays fp32 (pinned), in the loop's real step.

    A first run that never switches (the same seed and data) measures the first window's
    SNRs; ``gap`` puts snr_high where they are furthest apart, so some groups switch and some
    do not (here the blocks switch and the head stays); ``all`` puts it below them all."""
    window = 4

    def adaptive(snr_high: float, steps: int) -> TrainConfig:
        cfg = make_config(steps=steps)
        return cfg.model_copy(update={"precision": cfg.precision.model_validate({
            "mode": "adaptive", "low": low, "snr_window": window, "min_dwell": 0,
            "snr_high": snr_high, "snr_low": snr_high * 1e-6})})

    probe = ListSink()
    train(adaptive(1e30, window), probe)
    first = next(e for e in probe.events if isinstance(e, SNREvent))
    assert first.window_step == window and first.modes == ["fp32"] * 3
    ranked = sorted(zip(first.snr, first.groups, strict=True))
    if split == "gap":
        gap = max(range(len(ranked) - 1), key=lambda i: ranked[i + 1][0] / ranked[i][0])
        assert ranked[gap + 1][0] / ranked[gap][0] > 2, ranked  # a clear split, not rounding
        threshold = math.sqrt(ranked[gap][0] * ranked[gap + 1][0])
        switched, kept = {g for _, g in ranked[gap + 1:]}, {g for _, g in ranked[:gap + 1]}
    else:
        threshold, switched, kept = ranked[0][0] / 2, {g for _, g in ranked}, set()

    log, sink = _compute_log(adaptive(threshold, window + 2), monkeypatch)
    moves = {(e.step, e.group, e.before, e.after) for e in sink.events
             if isinstance(e, PrecisionEvent)}
    assert moves == {(window, g, "fp32", low) for g in switched}
    dtype = str({"bf16": torch.bfloat16, "fp16": torch.float16}[low]).removeprefix("torch.")
    groups = {c.module: c.group for c in log.calls}
    before = _seen(log.calls, steps=set(range(1, window + 1)))
    after = _seen(log.calls, steps={window + 1, window + 2})
    assert set(before) == set(after) == {f"blocks.{i}.{n}" for i in range(2) for n in _LINEARS
                                         } | {"head"}
    assert all(d == {"float32"} for d in before.values()), before  # every group starts fp32
    assert after == {m: {dtype if groups[m] in switched else "float32"} for m in after}
    assert {groups[m] for m in after} == switched | kept
    attention = _seen(log.calls, steps={window + 1, window + 2}, attention=True)
    assert attention == {f"blocks.{i}.attn": {dtype if f"block.{i}" in switched else "float32"}
                         for i in range(2)}
    assert {c.dtypes for c in log.calls if c.op == "embedding"} == {("float32", "int64")}


def test_sparse_telemetry_still_accounts_for_every_step(tmp_path: Path,
                                                        make_config: MakeConfig) -> None:
    cfg = make_config(tmp_path, steps=23)
    cfg = cfg.model_copy(update={"telemetry": cfg.telemetry.model_copy(update={"every": 5})})
    sink = ListSink()
    train(cfg, sink)
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [5, 10, 15, 20, 23]  # and always the last step
    assert sum(e.steps for e in steps) == 23


@pytest.mark.parametrize("mode", ["bf16", "fp16", "adaptive"])
def test_precision_modes_train_and_report(tmp_path: Path, make_config: MakeConfig,
                                          mode: str) -> None:
    cfg = make_config(tmp_path, steps=30)
    precision = {"mode": mode}
    if mode == "adaptive":  # thresholds that a tiny model's gradients cross within 30 steps
        precision |= {"snr_window": 4, "snr_high": 0.02, "snr_low": 0.01, "min_dwell": 4}
    cfg = cfg.model_copy(update={"precision": cfg.precision.model_validate(precision)})
    sink = ListSink()
    train(cfg, sink)
    losses = _losses(sink)
    assert losses[30] < losses[1] - 0.5, losses
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    if mode == "fp16":
        assert steps[-1].loss_scale > 1  # a GradScaler is at work
    if mode == "adaptive":
        switches = [e for e in sink.events if isinstance(e, PrecisionEvent)]
        assert switches and switches[0].before == "fp32" and switches[0].after == "bf16"
        # every report carries every group's SNR once a window has closed, not only switches
        snrs = [e for e in sink.events if isinstance(e, SNREvent)]
        assert [e.step for e in snrs] == [e.step for e in steps if e.step >= 4]
        assert all(e.window_step == e.step - e.step % 4 for e in snrs)
        assert snrs[0].groups == ["block.0", "block.1", "head"]
        assert all(math.isfinite(v) and v > 0 for e in snrs for v in e.snr)
        assert snrs[-1].modes == ["bf16"] * 3  # SNR ~1 or more: far above snr_high here


def test_fp8_without_torchao_fails_with_the_requirement(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    # with torchao (the test extra) fp8 runs, emulated on the CPU: tests/trainer/test_precision.py
    from traind.trainer import precision

    monkeypatch.setattr(precision, "torchao_available", lambda: False)
    cfg = make_config(tmp_path, steps=2)
    cfg = cfg.model_copy(update={"precision": cfg.precision.model_validate({"mode": "fp8"})})
    with pytest.raises(ValueError, match=r"precision\.mode: fp8 needs torchao"):
        train(cfg, ListSink())


def test_per_layer_reports(tmp_path: Path, make_config: MakeConfig) -> None:
    from traind.contracts.events import LayerEvent

    cfg = make_config(tmp_path, steps=12)
    cfg = cfg.model_copy(update={"telemetry": cfg.telemetry.model_copy(
        update={"layer_every": 5})})
    sink = ListSink()
    train(cfg, sink)
    reports = [e for e in sink.events if isinstance(e, LayerEvent)]
    assert [e.step for e in reports] == [5, 10, 12]  # and always the last step
    first = reports[0]
    assert first.layers == ["embed", "block.0", "block.1", "head"]
    assert all(g > 0 for g in first.grad_norm) and all(w > 0 for w in first.weight_norm)
    # AdamW's first steps move each weight by about lr per element: a small, nonzero ratio.
    assert all(0 < r < 0.5 for r in first.update_ratio), first.update_ratio


@pytest.mark.parametrize(
    ("name", "expected"),
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
     ("NVIDIA GeForce RTX 2060", None), ("cpu", None)],
)
def test_peak_flops_table(name: str, expected: float | None) -> None:
    from traind.trainer.device import peak_flops

    assert peak_flops(name) == expected


def test_the_peak_is_that_of_the_math_the_precision_runs() -> None:
    from traind.trainer.device import matmul_math, peak_flops

    assert [matmul_math(p) for p in ("fp32", "bf16", "fp16", "fp8", "adaptive")] == [
        "tf32", "bf16", "bf16", "fp8", "bf16"]
    assert peak_flops("NVIDIA H200", "fp8") == pytest.approx(2 * 989e12, rel=1e-3)
    assert peak_flops("NVIDIA H200", "fp32") == 989e12 / 2  # TF32
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on Ampere: no MFU
    assert peak_flops("cpu", "fp32") is None


def test_cpu_has_no_allocator_stats_and_no_peak(tmp_path: Path, make_config: MakeConfig) -> None:
    cfg = make_config(tmp_path, steps=2)
    sink = ListSink()
    train(cfg, sink)
    started = sink.events[0]
    assert isinstance(started, LifecycleEvent) and started.detail["peak_flops"] is None
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    assert all(e.cuda_memory == {} and not e.nonfinite for e in steps)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_rank_can_run_the_strategy_path(tmp_path: Path, make_config: MakeConfig,
                                            strategy: str) -> None:
    """parallel.single_rank_group: one rank forms its own group (outside torchrun) and the
    model is wrapped for real; under DDP the communication hook reduces every bucket. This is
    how bench/gpu_check.py runs DDP's hook path on NCCL with one GPU."""
    base = make_config(tmp_path, steps=6)
    cfg = base.model_copy(update={"parallel": base.parallel.model_copy(
        update={"strategy": strategy, "single_rank_group": True})})
    sink = ListSink()
    result = train(cfg, sink)
    assert result.step == 6 and not torch.distributed.is_initialized()  # left its group
    started = next(e for e in sink.events if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started.detail["strategy"] == strategy
    comm = [e for e in sink.events if isinstance(e, CommEvent)]
    if strategy == "ddp":
        assert sum(e.buckets for e in comm) >= 6  # every step's buckets went through the hook
        assert sum(c["calls"] for e in comm for c in e.collectives) >= 6
    else:
        assert comm == []


def test_default_threads_share_this_nodes_usable_cpus_among_its_ranks(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    # job.threads=0: 6 usable CPUs among this node's 3 ranks is 2 threads each (the old rule,
    # torch's count over the world size, gave 1 here: the fixture leaves torch at 1 thread)
    monkeypatch.setattr("traind.trainer.loop.usable_cpus", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = make_config(tmp_path, steps=2, threads=0)
    sink = ListSink()
    train(cfg, sink)
    assert torch.get_num_threads() == 2
    started = sink.events[0]
    assert isinstance(started, LifecycleEvent)
    assert (started.detail["threads"], started.detail["local_ranks"],
            started.detail["usable_cpus"]) == (2, 3, 6)
