"""Everything that needs an NVIDIA GPU, in one run of under 8 minutes (for a lent GPU machine).

    python bench/gpu_check.py            # prints one table; exit 1 if any check failed

Checks: the NVML collector on real hardware (series count, units that look physical); the
trainer on CUDA in fp32 / bf16 / fp16 / fp8 (fp8 needs torchao and compute capability 8.9+,
else its clear error is the expected result); CUDA-event phase timing; sliding-window attention
through flex_attention against the naive reference; the compression hook on NCCL (one rank:
the collectives are real NCCL calls); then bench/kernels_gpu.py's kernel checks and timings.
Throughput is printed per precision for the note.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

ROWS: list[tuple[str, str, str]] = []


def check(name: str, fn: Callable[[], str]) -> None:
    t0 = time.monotonic()
    try:
        detail = fn()
        status = "ok"
    except Exception as exc:  # a failed check is a row, not the end of the run
        detail = f"{type(exc).__name__}: {exc}"[:160]
        status = "FAIL"
        traceback.print_exc()
    ROWS.append((name, status, f"{detail} ({time.monotonic() - t0:.1f} s)"))
    print(f"{status:4s} {name}: {detail}", flush=True)


def nvml() -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from traind.metrics.gpu import GpuCollector

    reg = CollectorRegistry()
    gpu = GpuCollector()
    reg.register(gpu)
    generate_latest(reg)
    time.sleep(1.0)  # GPM needs two samples
    text = generate_latest(reg).decode()
    gpu.close()
    series = [x for x in text.splitlines() if x and not x.startswith("#")]
    get = reg.get_sample_value
    assert get("traind_gpu_collector_success") == 1.0, "collector_success != 1"
    power = get("traind_gpu_power_watts", {"gpu": "0"}) or 0
    clock = get("traind_gpu_clock_hertz", {"gpu": "0", "clock": "sm"}) or 0
    mem = get("traind_gpu_memory_total_bytes", {"gpu": "0"}) or 0
    assert 10 < power < 2000, f"power {power} W is not physical"
    assert 1e8 < clock < 5e9, f"SM clock {clock} Hz is not physical"
    assert mem > 8 * 2**30, f"memory {mem} bytes"
    unsupported = get("traind_gpu_collector_unsupported_fields")
    return (f"{len(series)} series, {power:.0f} W, SM {clock / 1e6:.0f} MHz, "
            f"{mem / 2**30:.0f} GiB, {unsupported:.0f} unsupported fields")


def train_tps(mode: str, steps: int = 60) -> str:
    from traind.trainer.config import TrainConfig
    from traind.trainer.events import StepEvent
    from traind.trainer.loop import train
    from traind.trainer.sink import ListSink

    cfg = TrainConfig.model_validate({
        "job": {"steps": steps, "batch_size": 16, "eval_every": 10**9,
                "checkpoint_every": 10**9, "device": "cuda"},
        "model": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024},
        "data": {"max_bytes": 8_000_000},
        "precision": {"mode": mode},
        "telemetry": {"every": 10},
    })
    sink = ListSink()
    result = train(cfg, sink)
    steps_ev = [e for e in sink.events if isinstance(e, StepEvent)][2:]
    phases = steps_ev[-1]
    assert result.loss is not None and result.loss < 5.0, f"loss {result.loss}"
    tps = sum(e.tokens for e in steps_ev) / sum(e.step_seconds for e in steps_ev)
    return (f"{tps:,.0f} tok/s, loss {result.loss:.3f}, phases fwd "
            f"{phases.forward_seconds * 1e3:.1f} ms bwd {phases.backward_seconds * 1e3:.1f} ms "
            f"opt {phases.optimizer_seconds * 1e3:.1f} ms")


def flex_attention() -> str:
    from traind.trainer.attention import attend, mask_matrix, naive_attention
    from traind.trainer.config import ModelConfig

    cfg = ModelConfig(attention="sliding_window", window=128, global_tokens=4, seq_len=1024)
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda") for _ in range(3))
    out = attend(q, k, v, cfg=cfg)
    ref = naive_attention(q, k, v, mask_matrix(1024, 128, 4, q.device))
    err = (out - ref).abs().max().item()
    assert err < 1e-2, f"max error {err}"
    return f"max |flex - naive| = {err:.2e}"


def nccl_hook() -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from traind.trainer.compression import CompressionHook
    from traind.trainer.config import CompressionConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda(), device_ids=[0])
        hook = CompressionHook(CompressionConfig(method="int8"))
        hook.register(model)
        out = []
        for method in ("none", "fp16", "bf16", "int8", "topk"):
            hook.set_method(method)
            for _ in range(3):
                model(torch.randn(64, 4096, device="cuda")).sum().backward()
            stats = hook.take_stats()
            out.append(f"{method} {stats.raw_bytes / max(1, stats.sent_bytes):.1f}x")
        return ", ".join(out)
    finally:
        dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, capability {props.major}.{props.minor}, torch {torch.__version__}")
    check("NVML collector", nvml)
    for mode in ("fp32", "bf16", "fp16", "fp8"):
        check(f"train {mode}", lambda m=mode: train_tps(m))  # type: ignore[misc]
    check("flex_attention sliding window", flex_attention)
    check("compression hook on NCCL", nccl_hook)
    # the Triton kernels: checks and timings (bench/ is on sys.path when run as a script)
    from kernels_gpu import run_all as kernel_rows

    ROWS.extend(kernel_rows())
    print("\n| check | status | detail |\n| --- | --- | --- |")
    for name, status, detail in ROWS:
        print(f"| {name} | {status} | {detail} |")
    return 0 if all(s == "ok" for _, s, _ in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
