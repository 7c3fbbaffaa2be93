from __future__ import annotations

import math
import shutil
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from traind.contracts.events import (
    CommEvent,
    EvalEvent,
    LifecycleEvent,
    PrecisionEvent,
    SNREvent,
    StepEvent,
)
from traind.trainer.checkpoint import latest, list_checkpoints, load_checkpoint
from traind.trainer.config import TrainConfig
from traind.trainer.device import peak_memory
from traind.trainer.loop import train
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


def test_bf16_autocast_runs(make_config: MakeConfig) -> None:
    cfg = make_config(steps=3)
    cfg = cfg.model_copy(update={"precision": cfg.precision.model_copy(update={"mode": "bf16"})})
    result = train(cfg, ListSink())
    assert result.step == 3 and result.loss is not None and result.loss < 7


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
