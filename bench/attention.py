"""Sliding-window attention backends side by side: forward+backward time per backend and shape.

    python bench/attention.py                    # this machine's CPU, and CUDA when present
    python bench/attention.py --device cuda      # one device only
    python bench/attention.py --cpu-flex-forward # also compile flex for the CPU (20-30 s/shape)

For each shape, every implementation of the rule is timed the way trainer/attention_choice.py
times it at first use (``backend_trial``: forward and backward on copies of the inputs;
``median_seconds``: two warm-up calls, then the median of five), so this table is the
evidence behind what ``auto`` picks, and its last column is what ``auto`` did pick, measured
again by a fresh chooser. ``ms`` is forward+backward, except in the rows named ``... fwd``
(forward only, against SDPA's forward). ``first s`` is the first call alone: it pays for
compiling (flex) or JIT (Triton). ``x sdpa`` is SDPA-with-mask's time over the backend's
(above 1: faster).
``sdpa is_causal`` is full causal attention, for scale: a window is worth having only where
it beats that. On CUDA fp32 runs twice, with TF32 off and on (the kernel honours the
setting). A backend that fails shows its error instead of a time.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from traind.trainer import attention
from traind.trainer.attention_choice import BackendChoice, candidates, median_seconds

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.attention_choice import Name

# (B, nh, T, hs, window, global_tokens)
CPU_SHAPES = [(4, 4, 256, 32, 32, 4), (4, 4, 1024, 32, 128, 4), (4, 4, 1024, 32, 32, 4)]
CUDA_SHAPES = [(4, 16, 1024, 64, 128, 4), (4, 16, 4096, 64, 512, 4),
               (4, 16, 8192, 64, 1024, 4), (4, 16, 8192, 64, 256, 4)]


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _time(trial: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(first call s, median ms after it)."""
    sync = _sync(device)
    sync()
    t0 = time.perf_counter()
    trial()
    sync()
    first = time.perf_counter() - t0
    return first, median_seconds(trial, sync=sync, warmup=1) * 1e3


def _causal_trial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def once() -> object:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        return torch.autograd.grad(out, leaves, leaves[0].detach())

    return once


def _flex_cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                      n_global: int) -> Callable[[], object]:
    block_mask = attention._cached_block_mask(q.size(-2), window, n_global, q.device)
    compiled = attention._compiled_flex()

    def once() -> object:
        with torch.no_grad():
            return compiled(q, k, v, block_mask=block_mask)

    return once


def rows_for(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], tf32: str,
             cpu_flex_forward: bool) -> list[list[str]]:
    B, H, T, hs, window, n_global = shape
    if device.type == "cuda":  # the new API only: once it is mixed with the legacy one,
        torch.backends.cuda.matmul.fp32_precision = tf32  # reading allow_tf32 raises
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, hs, device=device, dtype=dtype, generator=g)
               for _ in range(3))
    label = (f"{device.type} {str(dtype)[6:]}{' tf32' if tf32 == 'tf32' else ''} "
             f"B={B} nh={H} T={T} hs={hs} w={window} g={n_global}")
    names: list[Name] = ["sdpa_mask", "triton", "flex"]
    results: list[tuple[str, float | None, float | None, str]] = []
    for name in names:
        if name == "triton" and device.type != "cuda":
            results.append((name, None, None, "CUDA only (the interpreter is no speed)"))
            continue
        trial = attention.backend_trial(name, q, k, v, window=window, global_tokens=n_global,
                                        grad=True)
        try:
            first, ms = _time(trial, device)
            note = "compiled" if name == "flex" and device.type == "cuda" else ""
            results.append((name, first, ms, note))
        except Exception as exc:  # a backend that cannot run here is a row, not the end
            results.append((name, None, None, f"{type(exc).__name__}: {exc}"[:64]))
    first, ms = _time(_causal_trial(q, k, v), device)
    results.append(("sdpa is_causal", first, ms, "full attention, for scale"))
    if device.type == "cpu" and cpu_flex_forward:  # forward only: "x sdpa" is then fwd/fwd
        sdpa_fwd = attention.backend_trial("sdpa_mask", q, k, v, window=window,
                                           global_tokens=n_global, grad=False)
        first, ms = _time(sdpa_fwd, device)
        results.append(("sdpa_mask fwd", first, ms, "forward only"))
        first, ms = _time(_flex_cpu_forward(q, k, v, window, n_global), device)
        results.append(("flex compiled fwd", first, ms, "forward only: no CPU backward"))
    # what auto picks, measured again by a fresh chooser, as a training process would
    attention.CHOICE = BackendChoice()
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    picked = attention.auto_backend(qg, kg, vg, window=window, global_tokens=n_global,
                                    dropout_p=0.0)
    n_cand = len(candidates(device_type=device.type, has_triton=attention.kernel_dispatch
                            .use_triton(q), has_flex=attention.HAS_FLEX, dropout=False))
    base = {"fwd+bwd": results[0][2], "fwd": next((r[2] for r in results
                                                   if r[0] == "sdpa_mask fwd"), None)}
    out = []
    for name, first, ms, note in results:
        sdpa_ms = base["fwd" if name.endswith(" fwd") else "fwd+bwd"]
        ratio = f"{sdpa_ms / ms:.2f}" if ms and sdpa_ms else "-"
        auto = (f"<- auto ({n_cand} candidate{'s' if n_cand > 1 else ''})"
                if name == picked else "")
        out.append([label, name, "-" if first is None else f"{first:.2f}",
                    "-" if ms is None else f"{ms:.2f}", ratio, " ".join(x for x in (auto, note)
                                                                         if x)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["all", "cpu", "cuda"], default="all")
    parser.add_argument("--cpu-flex-forward", action="store_true",
                        help="also time compiled flex's forward on the CPU (compiles per shape)")
    args = parser.parse_args()
    runs: list[tuple[torch.device, torch.dtype, tuple[int, ...], str]] = []
    if args.device in ("all", "cpu"):
        runs += [(torch.device("cpu"), torch.float32, s, "ieee") for s in CPU_SHAPES]
    if args.device in ("all", "cuda") and torch.cuda.is_available():
        cuda = torch.device("cuda")
        runs += [(cuda, torch.bfloat16, s, "ieee") for s in CUDA_SHAPES]
        runs += [(cuda, torch.float32, CUDA_SHAPES[1], p) for p in ("ieee", "tf32")]
    elif args.device == "cuda":
        print("no CUDA device")
        return
    table = [["shape", "backend", "first s", "ms", "x sdpa", "note"]]
    for device, dtype, shape, tf32 in runs:
        table += rows_for(device, dtype, shape, tf32, args.cpu_flex_forward)
        print(f"done: {table[-1][0]}", flush=True)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    print()
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
