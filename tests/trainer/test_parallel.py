"""Real gloo ranks under torchrun: strategies agree with one process, and a SIGKILLed run
resumes onto the uninterrupted trajectory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from traind.contracts.events import EvalEvent, StepEvent, decode_complete
from traind.trainer.config import TrainConfig
from traind.trainer.distributed import DistInfo
from traind.trainer.loop import train
from traind.trainer.model import GPT
from traind.trainer.parallel import build_strategy, fsdp_dtypes
from traind.trainer.precision import build_policy
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
STEPS = 12
# Same data, same math, different reduction order (all-reduce or reduce-scatter of two halves
# versus one backward over the whole batch): float32 rounding, amplified a little by Adam.
TOLERANCE = 2e-3


def config(out_dir: Path, *, batch: int, steps: int = STEPS, **sections: dict[str, Any]
           ) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "job": {"steps": steps, "batch_size": batch, "threads": 1, "out_dir": str(out_dir),
                "eval_every": 10_000, "checkpoint_every": 10_000, "seed": 3},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def launch(tmp: Path, cfg: dict[str, Any], nproc: int) -> subprocess.Popen[bytes]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", "--max_restarts=0", "-m", "traind.trainer.worker",
         "--config", str(tmp / "config.json"), "--events-file", str(tmp / "events")],
        stdout=open(tmp / "log", "ab"), stderr=subprocess.STDOUT,
        start_new_session=True)


def losses(tmp: Path, rank: int) -> dict[int, float]:
    path = tmp / f"events.rank{rank}"
    if not path.exists():
        return {}
    events = decode_complete(path.read_bytes())
    return {e.step: e.loss for e in events if isinstance(e, StepEvent)}


def val_loss(tmp: Path, rank: int) -> float:
    """The rank's last validation loss (the run's end: a run evaluates once more there)."""
    events = decode_complete((tmp / f"events.rank{rank}").read_bytes())
    return [e.val_loss for e in events if isinstance(e, EvalEvent)][-1]


def run_ranks(tmp: Path, cfg: dict[str, Any], nproc: int = 2) -> list[dict[int, float]]:
    proc = launch(tmp, cfg, nproc)
    try:
        code = proc.wait(180)
    except subprocess.TimeoutExpired:  # never leave a hung job behind the rest of the suite
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert code == 0, (tmp / "log").read_text()[-4000:]
    return [losses(tmp, r) for r in range(nproc)]


def one_process(out_dir: Path, cfg: dict[str, Any]) -> dict[int, float]:
    sink = ListSink()
    train(TrainConfig.model_validate(cfg), sink)
    return {e.step: e.loss for e in sink.events if isinstance(e, StepEvent)}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_two_ranks_of_b_match_one_rank_of_2b(tmp_path: Path, strategy: str):
    sink = ListSink()
    whole = train(TrainConfig.model_validate(config(tmp_path / "one", batch=8)), sink)
    reference = {e.step: e.loss for e in sink.events if isinstance(e, StepEvent)}
    per_rank = run_ranks(tmp_path / "two",
                         config(tmp_path / "two", batch=4, parallel={"strategy": strategy}))
    assert sorted(per_rank[0]) == list(range(1, STEPS + 1))
    for step, expected in reference.items():
        mean = (per_rank[0][step] + per_rank[1][step]) / 2  # each rank's loss is of its half
        assert abs(mean - expected) < TOLERANCE, (strategy, step, mean, expected)
    assert reference[STEPS] < reference[1] - 0.5  # and it learned something
    # The held-out set is the global batch's too, each rank evaluating its half of it
    # (trainer/loop.py): one number on both ranks, the one rank's of the whole batch.
    vals = [val_loss(tmp_path / "two", rank) for rank in range(2)]
    assert whole.val_loss is not None and vals[0] == vals[1], vals
    assert abs(vals[0] - whole.val_loss) < TOLERANCE, (strategy, vals, whole.val_loss)


def test_grad_accumulation_counts_micro_batches(tmp_path: Path):
    cfg = config(tmp_path, batch=2, steps=3, parallel={"grad_accum": 4})
    sink = ListSink()
    result = train(TrainConfig.model_validate(cfg), sink)
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [1, 2, 3]
    assert all(e.tokens == 2 * 32 * 4 for e in steps)
    assert result.tokens == 3 * 2 * 32 * 4


def _wait_for_step(tmp: Path, step: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(losses(tmp, 0), default=0) >= step:
            return
        assert proc.poll() is None, (tmp / "log").read_text()[-4000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_mid_run_then_resume_follows_the_uninterrupted_run(tmp_path: Path,
                                                                     strategy: str):
    steps = 60  # long enough that the kill (after step 24) lands before the end
    sections = {"parallel": {"strategy": strategy}}
    full = run_ranks(tmp_path / "full",
                     config(tmp_path / "full" / "out", batch=4, steps=steps, **sections))[0]

    cut = tmp_path / "cut"
    cfg = config(cut / "out", batch=4, steps=steps, **sections)
    cfg["job"]["checkpoint_every"] = 10
    proc = launch(cut, cfg, 2)
    _wait_for_step(cut, 24, proc, timeout=120)
    # The launcher and both ranks, no goodbye (the ranks have sessions of their own).
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(losses(cut, 0))
    assert killed_at < steps
    (cut / "events.rank0").rename(cut / "events-before.rank0")
    (cut / "events.rank1").rename(cut / "events-before.rank1")

    resumed = run_ranks(cut, cfg)[0]
    first = min(resumed)
    assert first % 10 == 1 and first <= killed_at + 1, f"resumed at {first}, killed at {killed_at}"
    for step in range(first, steps + 1):
        assert abs(resumed[step] - full[step]) < 1e-5, (step, resumed[step], full[step])


def test_sharded_checkpoint_resumes_on_fewer_ranks(tmp_path: Path):
    out = tmp_path / "out"
    run_ranks(tmp_path / "two", config(out, batch=4, steps=10, parallel={"strategy": "fsdp"}))
    assert any(p.name.startswith("dcp_step_") for p in out.iterdir())
    # One process, batch 8: the same global batch, now resharded from two ranks into one.
    sink = ListSink()
    result = train(TrainConfig.model_validate(
        config(out, batch=8, steps=14, parallel={"strategy": "fsdp"})), sink)
    assert result.resumed_from == 10 and result.step == 14
    loss = {e.step: e.loss for e in sink.events if isinstance(e, StepEvent)}
    # The reference takes the same path in one process: 10 steps, then resumed to 14 (the lr
    # schedule follows job.steps, so both legs must match).
    one_process(tmp_path / "ref", config(tmp_path / "ref", batch=8, steps=10))
    reference = one_process(tmp_path / "ref", config(tmp_path / "ref", batch=8, steps=14))
    for step in range(11, 15):
        assert abs(loss[step] - reference[step]) < TOLERANCE, (step, loss[step], reference[step])


def _events(tmp: Path, rank: int) -> list[Any]:
    return decode_complete((tmp / f"events.rank{rank}").read_bytes())


def test_compression_reports_and_its_residuals_resume(tmp_path: Path):
    from traind.contracts.events import CommEvent, ProbeEvent
    from traind.trainer.checkpoint import load_checkpoint

    out = tmp_path / "out"
    cfg = config(out, batch=4, steps=20, compression={"method": "int8"},
                 telemetry={"probe_every": 10, "probe_sizes": [4096, 1 << 20],
                            "probe_repeats": 2})
    cfg["job"]["checkpoint_every"] = 10
    first = run_ranks(tmp_path, cfg)[0]
    comm = [e for e in _events(tmp_path, 1) if isinstance(e, CommEvent)]
    assert len(comm) == 20 and {e.method for e in comm} == {"int8"}
    assert all(3.5 < e.raw_bytes / e.sent_bytes < 4.0 for e in comm)
    assert all(0 < e.rel_error < 0.05 for e in comm)
    # Per-op figures: int8 sends every bucket in two phases (an all-to-all of shards, an
    # all-gather of the reduced one); each call lands in one latency bin.
    for e in comm:
        calls = {op: sum(c["calls"] for c in e.collectives if c["op"] == op)
                 for op in ("all_to_all", "all_gather")}
        assert {c["op"] for c in e.collectives} == set(calls)
        assert calls == {"all_to_all": e.buckets, "all_gather": e.buckets}
        # 2 ranks: the all-to-all sends half its message, the all-gather all of its own
        sent = sum(c["bytes"] // (2 if c["op"] == "all_to_all" else 1) for c in e.collectives)
        assert abs(sent - e.sent_bytes) <= e.buckets
        assert all(sum(c["counts"]) == c["calls"] and c["seconds"] > 0 for c in e.collectives)
    # DDP's own timing appears once its reducer has sampled an iteration.
    sampled = [e.ddp for e in comm if e.ddp]
    assert sampled and all(d["backward_comm"] > 0 and d["backward_compute"] > 0
                           and 0 <= d["backward_overlap"] <= d["backward_comm"] + 1e-3
                           for d in sampled)
    probes = [e for e in _events(tmp_path, 0) if isinstance(e, ProbeEvent)]
    assert [p.step for p in probes] == [10, 20]
    assert probes[0].sizes == [4096, 1 << 20] and all(t > 0 for t in probes[0].seconds)
    saved = load_checkpoint(out / "step_00000010.pt")["compression"]
    assert [s["method"] for s in saved] == ["int8", "int8"] and all(s["residuals"] for s in saved)

    # Resume from step 10 with the residuals: the same steps 11..20 as the first run, up to
    # quantization noise: DDP's first iteration after a restart lays its bucket out in another
    # order, so int8's 256-element blocks (and their scales) fall differently for one step.
    # (Residuals are small next to gradients, so this cannot tell a restored residual from a
    # dropped one; test_compression checks the restore itself, by parameter name.)
    (out / "step_00000020.pt").unlink()
    for rank in (0, 1):
        (tmp_path / f"events.rank{rank}").unlink()
    again = run_ranks(tmp_path, cfg)[0]
    assert min(again) == 11
    assert again[11] == first[11]
    for step in range(12, 21):
        assert abs(again[step] - first[step]) < 5e-4, (step, again[step], first[step])


def test_compression_without_ddp_is_a_clear_error(tmp_path: Path):
    cfg = TrainConfig.model_validate(config(tmp_path, batch=4, compression={"method": "topk"}))
    with pytest.raises(ValueError, match=r"compression.method 'topk' .* more than one rank"):
        train(cfg, ListSink())


def test_compression_arms_interleave_in_a_running_ddp_job(tmp_path: Path):
    from traind.contracts.events import ArmEvent, CommEvent

    cfg = config(tmp_path / "out", batch=4, steps=16, interleave={
        "arms": [{"name": "none"}, {"name": "int8", "compression": {"method": "int8"}}],
        "block_steps": 4, "warmup_steps": 1})
    run_ranks(tmp_path, cfg)
    events = _events(tmp_path, 1)
    blocks = [e for e in events if isinstance(e, ArmEvent)]
    assert [b.arm for b in blocks] == ["none", "int8", "int8", "none"]
    # Gradient fidelity per block: lossless for none, int8's rounding for int8.
    assert all(b.grad_error == 0.0 for b in blocks if b.arm == "none")
    assert all(0 < b.grad_error < 0.05 for b in blocks if b.arm == "int8")
    # Each communication window holds one method: the arm's.
    comm = [e for e in events if isinstance(e, CommEvent) and e.steps]
    for e in comm:
        block = (e.step - 1) // 4
        assert e.method == ["none", "int8", "int8", "none"][block], (e.step, e.method)
    assert {e.method for e in comm} == {"none", "int8"}
    ops = {"none": {"all_reduce"}, "int8": {"all_to_all", "all_gather"}}  # int8: two phases
    assert all({c["op"] for c in e.collectives} == ops[e.method] for e in comm)


def test_a_promoted_compression_switches_every_rank_at_the_same_boundary(tmp_path: Path):
    from traind.contracts.control import FILENAME, Control, write_control
    from traind.contracts.events import CommEvent, LifecycleEvent

    out = tmp_path / "out"
    cfg = config(out, batch=4, steps=12)
    cfg["job"]["checkpoint_every"] = 6
    # Written before the start (a mid-run write would race the tiny job's pace; the
    # single-process test covers the boundary): rank 0 reads it, both ranks switch.
    write_control(out / FILENAME, Control(seq=1, setting={"compression": {"method": "int8"}}))
    run_ranks(tmp_path, cfg)
    for rank in (0, 1):
        events = _events(tmp_path, rank)
        promoted = [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "promoted"]
        assert [(e.step, e.detail["error"]) for e in promoted] == [(0, None)], rank
        methods = {e.method for e in events if isinstance(e, CommEvent) and e.steps}
        assert methods == {"int8"}


# ---------------------------------------------------------------- FSDP2 mixed precision

@pytest.mark.parametrize(("precision", "reduce", "expected"), [
    ("fp32", "fp32", (None, None)),
    ("bf16", "fp32", (torch.bfloat16, torch.float32)),
    ("bf16", "bf16", (torch.bfloat16, torch.bfloat16)),
    ("fp16", "fp32", (torch.float16, torch.float32)),
    ("fp8", "fp32", (torch.bfloat16, torch.float32)),
    ("adaptive", "bf16", (None, None)),  # each block's autocast decides: fp32 weights
])
def test_fsdp_dtypes_follow_the_precision_mode(precision: str, reduce: str,
                                               expected: tuple[Any, Any]) -> None:
    assert fsdp_dtypes(precision, reduce) == expected


def _fsdp_rank(rank: int, store: str, precision: str, seen: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        gathered: list[torch.dtype] = []
        reduced: list[torch.dtype] = []
        gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

        def all_gather_single(*args: Any, **kw: Any) -> Any:
            gathered.append((args or [kw["output_tensor"]])[0].dtype)
            return gather(*args, **kw)

        def reduce_scatter_single(*args: Any, **kw: Any) -> Any:
            reduced.append((args or [kw["output"]])[0].dtype)
            return scatter(*args, **kw)

        # FSDP2 issues its collectives through these two (torch.distributed's module
        # attributes): recording them shows what really went on the wire.
        dist.all_gather_single = all_gather_single  # type: ignore[assignment]
        dist.reduce_scatter_single = reduce_scatter_single  # type: ignore[assignment]
        cfg = TrainConfig.model_validate({
            "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "precision": {"mode": precision}, "parallel": {"strategy": "fsdp"}})
        torch.manual_seed(0)
        model = GPT(cfg.model)
        info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"),
                        owns_group=False)
        strategy = build_strategy(cfg.parallel, info, precision)
        weights: list[torch.dtype] = []
        qkv = model.blocks[0].attn.q
        qkv.register_forward_pre_hook(lambda m, a: weights.append(m.weight.dtype))
        strategy.wrap(model)
        x = torch.randint(0, 256, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            _, loss = model(x, x)
        assert loss is not None
        loss.backward()
        grad = model.blocks[0].attn.q.weight.grad
        assert grad is not None
        seen[rank] = (weights[0], sorted({str(d) for d in gathered}),
                      sorted({str(d) for d in reduced}),
                      model.blocks[0].attn.q.weight.dtype, grad.dtype)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp_gathers_bf16_weights_and_reduces_fp32_under_bf16(tmp_path: Path,
                                                                precision: str) -> None:
    seen = mp.Manager().dict()
    mp.start_processes(_fsdp_rank, args=(str(tmp_path / "store"), precision, seen), nprocs=2,
                       start_method="fork")
    low = precision == "bf16"
    for rank in range(2):
        weight, gathered, reduced, master, grad = seen[rank]
        # the forward sees the gathered weights: bf16 under bf16, fp32 otherwise
        assert weight == (torch.bfloat16 if low else torch.float32)
        assert gathered == (["torch.bfloat16"] if low else ["torch.float32"])
        assert reduced == ["torch.float32"]  # gradients are summed in fp32 either way
        # the sharded master weights and their gradients stay fp32 for the optimizer
        assert master == torch.float32 and grad == torch.float32


def _fp16_overflow_rank(rank: int, store: str, seen: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        cfg = TrainConfig.model_validate({
            "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "precision": {"mode": "fp16"}, "parallel": {"strategy": "fsdp"}})
        torch.manual_seed(0)
        model = GPT(cfg.model)
        policy = build_policy(cfg.precision, torch.device("cpu"))
        info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"),
                        owns_group=False)
        strategy = build_strategy(cfg.parallel, info, "fp16")
        strategy.wrap(model)
        opt = strategy.optimizer(model, cfg.optim)
        x = torch.randint(0, 256, (2, 16))
        with policy.autocast():
            _, loss = model(x, x)
        assert loss is not None
        policy.backward(loss)
        if rank == 0:  # an overflow in a shard only rank 0 holds
            grad = model.blocks[0].mlp.down.weight.grad
            assert grad is not None
            grad.to_local().view(-1)[0] = float("inf")
        seen[rank] = (policy.step(opt), policy.loss_scale)
    finally:
        dist.destroy_process_group()


def test_an_fp16_overflow_in_one_shard_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """FSDP2's gradients are shards: were the scaler's overflow check per rank, rank 1 would
    step on with another loss scale than rank 0, and the next reduce-scatter would sum
    gradients of two scales. torch 2.13 agrees on it through DTensor; this keeps it so."""
    seen = mp.Manager().dict()
    mp.start_processes(_fp16_overflow_rank, args=(str(tmp_path / "store"), seen),
                       nprocs=2, start_method="fork")
    assert seen[0] == seen[1] == (False, 2.0**15)  # both skipped and halved the scale


def _stage_overflow_rank(rank: int, store: str, seen: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        policy = build_policy(TrainConfig.model_validate(
            {"precision": {"mode": "fp16"}}).precision, torch.device("cpu"))
        policy.agree_on_overflow(dist.group.WORLD)
        # as a pipeline's stages: each rank its own parameters, and only the last computes
        # (and scales) the loss; the first one's gradients arrive scaled all the same
        torch.manual_seed(rank)
        layer = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
        out = layer(torch.randn(2, 4)).square().mean()
        (policy.scale(out) if rank == 1 else out * policy.loss_scale).backward()
        if rank == 0:  # an overflow on the stage without the loss
            assert layer.weight.grad is not None
            layer.weight.grad[0, 0] = float("inf")
        seen[rank] = (policy.step(opt), policy.loss_scale)
    finally:
        dist.destroy_process_group()


def test_an_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path: Path) -> None:
    """A pipeline's stages hold different parameters, so each scaler finds only its own
    stage's overflow: PrecisionPolicy.agree_on_overflow makes one verdict of them (without
    it, measured: the stage with the loss steps on at its scale, the other skips and halves
    its own)."""
    seen = mp.Manager().dict()
    mp.start_processes(_stage_overflow_rank, args=(str(tmp_path / "store"), seen),
                       nprocs=2, start_method="fork")
    assert seen[0] == seen[1] == (False, 2.0**15)  # both skipped and halved the scale
