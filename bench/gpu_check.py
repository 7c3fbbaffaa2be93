"""Everything that needs an NVIDIA GPU, in one run of under 8 minutes (for a lent GPU machine).

    python bench/gpu_check.py                    # two tables; exit 1 if anything failed
    python bench/gpu_check.py --device cpu --steps 8 --only "ddp fp32 (hook)"   # the CPU twin

The product first: ``traind run``'s own path (the daemon's Job, torchrun, the worker, events over
the socket) for each setting of :data:`SETTINGS` -- DDP with its communication hook on NCCL
(one rank in a group of its own: ``parallel.single_rank_group``), bf16, fp8 (tensorwise and
rowwise), compile on and off, sliding-window attention, FSDP, adaptive precision -- a small
model for a few hundred steps each, with tokens/s, MFU, peak memory and pass/fail per setting
as one table. Then the checks: the NVML collector on real hardware (series count, units that
look physical, GPM), sliding-window attention through flex_attention against the naive
reference, the compression hook's per-collective timing on NCCL, a profile on demand on the
device timeline, and bench/kernels_gpu.py's kernel checks and timings.

``--device cpu`` runs the same table on the CPU with a tiny model (what the test suite does, so
the script's code runs everywhere); the GPU-only checks are left out there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.contracts.events import Event
    from traind.trainer.config import PrecisionConfig, TrainConfig

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


# Each setting: a name and the config overrides it makes on top of BASE. What "passes": the
# job exits 0, the loss falls, and the setting's own figure checks (see product_row).
HOOK = {"parallel": {"strategy": "ddp", "single_rank_group": True}}
WIDE = {"d_model": 2048, "n_heads": 16, "n_layers": 4}
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("ddp fp32 (hook)", HOOK),
    ("ddp bf16 (hook)", {**HOOK, "precision": {"mode": "bf16"}}),
    ("ddp bf16 int8 (hook)", {**HOOK, "precision": {"mode": "bf16"},
                              "compression": {"method": "int8"}}),
    ("bf16 eager", {"precision": {"mode": "bf16"}, "job": {"compile": False}}),
    ("bf16 compile", {"precision": {"mode": "bf16"}, "job": {"compile": True}}),
    # fp8 at a width where torchao's thresholds convert layers under both recipes (at 512
    # rowwise converts none); its bf16 twin is the ratio to read
    ("wide bf16 compile", {"precision": {"mode": "bf16"}, "job": {"compile": True},
                           "model": WIDE}),
    ("wide fp8 tensorwise compile", {"precision": {"mode": "fp8", "fp8_recipe": "tensorwise"},
                                     "job": {"compile": True}, "model": WIDE}),
    ("wide fp8 rowwise compile", {"precision": {"mode": "fp8", "fp8_recipe": "rowwise"},
                                  "job": {"compile": True}, "model": WIDE}),
    ("sliding window bf16 eager", {"precision": {"mode": "bf16"}, "job": {"compile": False},
                                   "model": {"attention": "sliding_window", "window": 128}}),
    ("sliding window bf16 compile", {"precision": {"mode": "bf16"}, "job": {"compile": True},
                                     "model": {"attention": "sliding_window", "window": 128}}),
    ("fsdp bf16", {"parallel": {"strategy": "fsdp", "single_rank_group": True},
                   "precision": {"mode": "bf16"}}),
    ("adaptive", {"precision": {"mode": "adaptive"}}),
]
GPU_SHAPE = {"d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 512}
# the CPU twin keeps its tiny width whatever a setting asks (emulated fp8 converts any size)
CPU_SHAPE_KEYS = ("d_model", "n_heads", "n_layers")
CPU_SHAPE = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def setting_config(over: dict[str, Any], device: str, steps: int) -> TrainConfig:
    from traind.trainer.config import TrainConfig

    base = {
        "job": {"steps": steps, "batch_size": 16 if device == "cuda" else 4,
                "eval_every": 10**9, "checkpoint_every": 10**9, "device": device,
                "resume": False},
        "model": GPU_SHAPE if device == "cuda" else CPU_SHAPE,
        "data": {"max_bytes": 8_000_000 if device == "cuda" else 200_000},
        "optim": {"warmup_steps": min(50, steps // 4)},
        "telemetry": {"every": 5 if device == "cuda" else 1},
    }
    tree = merge(base, over)
    if device == "cpu":
        tree["model"].update({k: CPU_SHAPE[k] for k in CPU_SHAPE_KEYS})
    return TrainConfig.model_validate(tree)


def product_row(name: str, over: dict[str, Any], device: str, steps: int
                ) -> tuple[str, str, str, str, str, str]:
    """(setting, status, tokens/s, MFU, peak memory, detail) of one ``traind run``."""
    from speed import run_job, throughput

    from traind.contracts.events import CommEvent, LifecycleEvent, StepEvent
    from traind.metrics.throughput import mfu

    t0 = time.monotonic()
    try:
        events = run_job(setting_config(over, device, steps))
        reports = [e for e in events if isinstance(e, StepEvent)]
        starts = [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "started"]
        started = starts[0]
        losses = [e.loss for e in reports]
        assert losses[-1] < losses[0], f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
        tps = throughput(events, warmup=max(2, steps // 5))
        # the one MFU (metrics/throughput.py) over every rank's peak; each setting runs one
        # rank, so tps (that rank's) is the job's
        share = mfu(tps, started.detail.get("flops_per_token"),
                    [e.detail.get("peak_flops") for e in starts])
        mem = max((e.cuda_memory.get("peak_allocated_bytes", 0.0) for e in reports),
                  default=0.0)
        detail = f"loss {losses[0]:.2f} -> {losses[-1]:.2f}"
        if device == "cuda":  # the run's CUDA-only lines (tests/trainer/test_cuda_paths.py)
            name_ = started.detail["device_name"]
            assert started.detail["peak_flops"], f"{name_!r} not in PEAK_FLOPS: no MFU"
            assert mem > 0, "no CUDA allocator figures in the step reports"
            last = reports[-1]  # phases timed by CUDA events, read at telemetry steps
            assert last.forward_seconds > 0 and last.backward_seconds > 0, last
        if over.get("parallel", {}).get("strategy") == "ddp":
            comm = [e for e in events if isinstance(e, CommEvent)]
            calls = sum(c["calls"] for e in comm for c in e.collectives)
            seconds = sum(e.allreduce_seconds for e in comm)
            assert calls > 0, "the hook recorded no collective"
            detail += f"; {calls} collectives, {seconds * 1e3:.1f} ms in them"
        fallback = [e for e in events if isinstance(e, LifecycleEvent)
                    and e.phase == "compile_fallback"]
        assert not fallback, f"compile fell back to eager: {fallback[0].detail}"
        if over.get("job", {}).get("compile"):
            assert started.detail["compile"].startswith("on"), started.detail["compile"]
        if over.get("precision", {}).get("mode") == "fp8":
            layers = started.detail["fp8_layers"]
            assert layers, "fp8 converted no Linear layer"
            detail += f"; {len(layers)} fp8 layers"
        row = (name, "ok", f"{tps:,.0f}", f"{share:.1%}" if share is not None else "-",
               f"{mem / 2**30:.2f} GiB" if mem else "-",
               f"{detail} ({time.monotonic() - t0:.0f} s)")
    except Exception as exc:  # a failed setting is a row, not the end of the run
        traceback.print_exc()
        row = (name, "FAIL", "-", "-", "-", f"{type(exc).__name__}: {exc}"[:200])
    print(" | ".join(row), flush=True)
    return row


def flex_attention() -> str:
    from traind.trainer.attention import attend, mask_matrix, naive_attention
    from traind.trainer.config import ModelConfig

    cfg = ModelConfig(attention="sliding_window", window=128, global_tokens=4, seq_len=1024)
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda") for _ in range(3))
    out = attend(q, k, v, cfg=cfg, backend="flex")  # flex itself, not auto's pick
    ref = naive_attention(q, k, v, mask_matrix(1024, 128, 4, q.device))
    err = (out - ref).abs().max().item()
    assert err < 1e-2, f"max error {err}"
    return f"max |flex - naive| = {err:.2e}"


def attention_backends() -> str:
    """The Triton kernel against an fp64 twin with TF32 off and on (through the dispatch path),
    then what ``auto`` picks per shape: each pick matches the naive oracle, none failed."""
    from traind.kernels import swa
    from traind.trainer import attention
    from traind.trainer.attention_choice import BackendChoice
    from traind.trainer.config import ModelConfig

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    prev, out = torch.backends.cuda.matmul.fp32_precision, []
    try:
        w, g = 256, 4
        q, k, v = (torch.randn(2, 8, 2048, 64, device="cuda", requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        ref = swa.swa_torch(q.double(), k.double(), v.double(), w, g)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
        errs = {}
        for setting in ("ieee", "tf32"):
            torch.backends.cuda.matmul.fp32_precision = setting  # the dispatch path reads it
            o = swa.sliding_window_attention(q, k, v, window=w, global_tokens=g)
            grads = torch.autograd.grad(o, (q, k, v), do)
            errs[setting] = max(rel(o, ref), *(rel(a, b) for a, b in zip(grads, ref_grads,
                                                                         strict=True)))
        assert errs["ieee"] < 2e-5 and errs["ieee"] < errs["tf32"] < 8e-3, errs
        out.append(f"fp32 err ieee {errs['ieee']:.1e} tf32 {errs['tf32']:.1e}")
        attention.CHOICE = BackendChoice()
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # as loop.py sets on CUDA
        for dtype, t, w in [(torch.bfloat16, 1024, 128), (torch.bfloat16, 8192, 1024),
                            (torch.float32, 4096, 512)]:
            cfg = ModelConfig(attention="sliding_window", window=w, global_tokens=4, seq_len=t)
            q, k, v = (torch.randn(2, 8, t, 64, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            y = attention.attend(q, k, v, cfg=cfg)
            ref = attention.naive_attention(*(x[:, :2].float() for x in (q, k, v)),
                                            attention.mask_matrix(t, w, 4, q.device))
            assert rel(y[:, :2], ref) < (2e-2 if dtype == torch.bfloat16 else 8e-3)
        decided = attention.CHOICE.decided()
        assert len(decided) == 3
        assert all(s is not None for d in decided.values() for _, s in d.seconds), decided
        out += [f"{str(kk.dtype)[6:]} T={kk.shape[2]} w={kk.window}: {d.name} (" + ", ".join(
            f"{n} {s * 1e3:.2f} ms" for n, s in d.seconds) + ")" for kk, d in decided.items()]
    finally:
        torch.backends.cuda.matmul.fp32_precision = prev
    return "; ".join(out)


# Adaptive runs at its default thresholds (snr_high 30): the default job reaches them. Its
# recorded gradient trace (tests/trainer/fixtures/adaptive_default_trace.json, CPU) drops the
# head to bf16 at step 64 and every block by step 272, inside the check's 320 steps; the
# verdict below names the SNRs the run reported if a GPU's run does not.


def adaptive_verdict(events: list[Event], cfg: PrecisionConfig) -> str:
    """Whether adaptive precision switched exactly where the run's own reported SNRs say it
    must: ``next_mode`` (the policy's rule) replayed over every window's SNR (the
    SNREvents; every window must be reported) gives the switches the run announced
    (PrecisionEvents), and at least 3 groups went down to ``cfg.low``. The check reads the
    threshold's meaning from the run, not from a figure guessed beforehand: a run whose SNRs
    never pass ``snr_high`` fails here, naming the SNRs it did report. ``cfg``: the run's
    PrecisionConfig."""
    import math

    from traind.contracts.events import PrecisionEvent, SNREvent
    from traind.trainer.precision import next_mode

    windows: dict[int, dict[str, float]] = {}
    for e in events:
        if isinstance(e, SNREvent) and e.window_step > 0:
            windows[e.window_step] = dict(zip(e.groups, e.snr, strict=True))
    w = cfg.snr_window
    assert windows, "no SNR reported"
    assert sorted(windows) == list(range(w, max(windows) + 1, w)), \
        f"not every window reported: {sorted(windows)}"
    assert all(math.isfinite(s) for snr in windows.values() for s in snr.values()), windows
    modes: dict[str, str] = {}
    last: dict[str, int] = {}
    due = []
    for step in sorted(windows):
        for group, snr in windows[step].items():
            before = modes.get(group, "fp32")
            after = next_mode(before, snr, step - last.get(group, 0), cfg)
            if after != before:
                modes[group], last[group] = after, step
                due.append((step, group, before, after))
    made = [(e.step, e.group, e.before, e.after) for e in events
            if isinstance(e, PrecisionEvent) and e.before != e.after]
    assert sorted(made) == sorted(due), f"switches made {made}, due by the run's SNRs {due}"
    down = {g for _, g, _, after in due if after == cfg.low}
    peak = {g: round(max(s[g] for s in windows.values() if g in s), 1)
            for g in windows[max(windows)]}
    assert len(down) >= 3, (f"{len(down)} groups switched to {cfg.low} (snr_high "
                            f"{cfg.snr_high}); the highest SNR each group reported: {peak}")
    return (f"{len(made)} switches, all where the run's SNRs put them; {len(down)} groups "
            f"reached {cfg.low}; highest SNR by group {peak}")


def adaptive_precision() -> str:
    """The per-group squared-norm kernel against its twin on CUDA, then adaptive precision on
    CUDA: groups drop to bf16 where, and only where, the run's own SNRs say
    (:func:`adaptive_verdict`)."""
    from traind.kernels import grad_stats
    from traind.trainer.config import TrainConfig
    from traind.trainer.loop import train
    from traind.trainer.sink import ListSink

    grads = [torch.randn(n, device="cuda") for n in (5, 2049, 4096 * 7, 1)]
    group_of = torch.tensor([0, 0, 1, 2], device="cuda")
    fused = grad_stats.group_sq_norms(grads, group_of, 3)  # Triton on CUDA
    twin = grad_stats.group_sq_norms_torch(grads, group_of, 3)
    err = ((fused - twin).abs() / twin).max().item()
    assert err < 1e-5, f"kernel vs twin {err}"
    cfg = TrainConfig.model_validate({
        "job": {"steps": 320, "device": "cuda", "eval_every": 10**9,
                "checkpoint_every": 10**9},
        "telemetry": {"every": 16},  # = snr_window: every window reported, as the verdict needs
        "precision": {"mode": "adaptive"}})
    sink = ListSink()
    train(cfg, sink)
    return f"kernel rel err {err:.1e}; " + adaptive_verdict(sink.events, cfg.precision)


def nccl_hook() -> str:
    """The compression hook on NCCL (one rank): every method's collectives counted per op and
    timed by CUDA events (real seconds, not the 0 of an enqueue); none's average is exact."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from traind.trainer.compression import CompressionHook
    from traind.trainer.config import CompressionConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 1024)).cuda()
        ref = copy.deepcopy(net)
        model = DistributedDataParallel(net, device_ids=[0], bucket_cap_mb=1)
        hook = CompressionHook(CompressionConfig(method="none", powersgd_start_step=2))
        hook.register(model)
        out = []
        for method in ("none", "fp16", "bf16", "int8", "topk", "powersgd"):
            hook.set_method(method)
            for _ in range(3):
                model.zero_grad()
                model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
            hook.take_stats()  # warm-up window
            x = torch.randn(64, 1024, device="cuda")
            model.zero_grad()
            model(x).square().mean().backward()
            torch.cuda.synchronize()
            if method == "none":  # world 1: the average is this rank's own gradient
                ref.zero_grad()
                ref(x).square().mean().backward()
                for p, q in zip(net.parameters(), ref.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad)
            s = hook.take_stats()
            calls: dict[str, int] = {}
            for c in s.collectives:
                calls[c["op"]] = calls.get(c["op"], 0) + c["calls"]
            if method in ("int8", "topk"):
                assert calls == {"all_to_all": s.buckets, "all_gather": s.buckets}, calls
            elif method == "powersgd":
                assert calls["all_reduce"] > s.buckets, calls  # vectors / P / Q counted apart
            else:
                assert calls == {"all_reduce": s.buckets}, calls
            assert s.allreduce_seconds > 0, f"{method}: event-clock seconds are 0"
            assert all(c["seconds"] > 0 for c in s.collectives)
            out.append(f"{method} {calls} {1e3 * s.allreduce_seconds:.2f} ms")
        return "; ".join(out)
    finally:
        dist.destroy_process_group()


def profile_on_cuda() -> str:
    """A profile on demand on CUDA (trainer/profiling.py's CUDA activity and its synchronize
    before the trace is written; daemon/profiles/analysis.py on the device timeline): the
    trace holds the steps' kernels, and the report splits them."""
    import tempfile
    import threading
    from pathlib import Path

    from traind.contracts.control import PROFILE_REQUEST, ProfileRequest, write_profile_request
    from traind.daemon.profiles.analysis import load_trace, report
    from traind.trainer.config import TrainConfig
    from traind.trainer.loop import train
    from traind.trainer.sink import ListSink

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write_profile_request(out / PROFILE_REQUEST, ProfileRequest(capture=1, steps=3))
        cfg = TrainConfig.model_validate({
            "job": {"steps": 40, "device": "cuda", "out_dir": str(out), "eval_every": 10**9,
                    "checkpoint_every": 10**9},
            "precision": {"mode": "bf16"}, "telemetry": {"every": 10}})
        train(cfg, ListSink(), stop=threading.Event())
        trace = out / "profiles" / "1" / "rank0.json.gz"
        body, size = report({0: load_trace(trace)}, {}), trace.stat().st_size
    r = body["ranks"][0]
    assert r["timeline"] == "device" and r["compute_ms"] > 0, r
    assert body["steps"] == [11, 12, 13], body["steps"]
    peak = max(m["peak_mib"] for m in r["memory"].values())
    return (f"{r['window_ms']:.1f} ms traced: compute {r['compute_ms']:.1f}, idle "
            f"{r['idle_ms']:.1f}; top kernel {r['top_ops'][0]['name'][:40]}; peak "
            f"{peak:.0f} MiB; trace {size / 2**20:.1f} MiB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=0, help="steps per setting (default: 300 on "
                   "CUDA, 20 on the CPU)")
    p.add_argument("--only", default="", help="comma-separated setting names")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (--device cpu runs the CPU twin)")
        return 1
    steps = args.steps or (300 if args.device == "cuda" else 20)
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = only - {n for n, _ in SETTINGS}
    if unknown:
        p.error(f"--only: unknown settings {sorted(unknown)}")
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, capability {props.major}.{props.minor}, torch {torch.__version__}")
    product = [product_row(name, over, args.device, steps) for name, over in SETTINGS
               if not only or name in only]
    print(f"\n| setting ({steps} steps, traind run) | status | tokens/s | MFU | peak memory "
          "| detail |\n| --- | --- | --- | --- | --- | --- |")
    for row in product:
        print("| " + " | ".join(row) + " |")
    if args.device == "cuda":
        check("NVML collector", nvml)
        check("flex_attention sliding window", flex_attention)
        check("attention: TF32 and the measured backend", attention_backends)
        check("compression hook on NCCL", nccl_hook)
        check("adaptive precision", adaptive_precision)
        check("profile on demand (CUDA activity)", profile_on_cuda)
        # the Triton kernels: checks and timings (bench/ is on sys.path when run as a script)
        from kernels_gpu import run_all as kernel_rows

        ROWS.extend(kernel_rows())
        print("\n| check | status | detail |\n| --- | --- | --- |")
        for name, status, detail in ROWS:
            print(f"| {name} | {status} | {detail} |")
    ok = all(r[1] == "ok" for r in product) and all(s == "ok" for _, s, _ in ROWS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
