"""A bare nanoGPT-style training loop: the yardstick traind's trainer must not fall behind.

    python bench/bare_loop.py --steps 30 --warmup 5 [--compile] [--fused]   # one JSON line

No telemetry, no threads, no events: ``get_batch`` slices random windows of a byte tensor (as
nanoGPT's does), then forward, backward, grad clip, AdamW, zero_grad. The model is traind's
own GPT (same shape, same init), so a ratio against ``traind run`` measures the trainer
around the model, not a different model (on the CPU: a bench for this machine). AdamW gets
nanoGPT's two parameter groups; it and the clip use the multi-tensor (foreach) kernels, as
nanoGPT does on CUDA when its fused AdamW is off, so the yardstick is a strong loop, not
torch's CPU default (a per-parameter Python loop, seconds slower per step at the bench shape).
``--fused`` takes AdamW's fused kernel instead, which traind uses on CPU and CUDA (6x
foreach's speed alone on this CPU, ``bench/optimizer.py``; 0.4% of a step at the bench
shape): a loop with the same kernels as traind's, to tell the trainer's overhead from its
choice of kernel. The lr follows the same
warm-up and cosine.

``--compile`` compiles the whole model (nanoGPT's ``torch.compile(model)``);
``--compile-blocks`` each block's forward only, as traind's ``job.compile`` does (the
embedding, final norm, head and loss stay eager): the two tell what per-block compile
leaves. Printed: tokens per second over the steps after ``--warmup`` (the compile happens
inside the warm-up), and each of those steps' seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from traind.trainer.config import ModelConfig
from traind.trainer.model import GPT


def corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's source, as traind's default corpus is (uint8, up to max_bytes)."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:max_bytes]), dtype=torch.uint8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-blocks", action="store_true", help="traind's per-block compile")
    p.add_argument("--fused", action="store_true", help="AdamW's fused kernel (traind's)")
    args = p.parse_args()

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                      seq_len=args.seq)
    model = GPT(cfg)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if args.fused else {"foreach": True}))
    step_fn = torch.compile(model) if args.compile else model
    if args.compile_blocks:
        from traind.trainer.compile import compile_blocks
        compile_blocks(model)
    data = corpus(32 * 2**20)
    B, T = args.batch, args.seq

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([data[i:i + T] for i in ix.tolist()]).long()  # (B, T)
        y = torch.stack([data[i + 1:i + 1 + T] for i in ix.tolist()]).long()  # (B, T)
        return x, y

    def lr_at(it: int) -> float:
        warm = 50
        if it < warm:
            return args.lr * (it + 1) / warm
        progress = min(1.0, (it - warm) / max(1, 2000 - warm))
        return 0.1 * args.lr + 0.5 * (1 + math.cos(math.pi * progress)) * 0.9 * args.lr

    t0 = 0.0
    ends: list[float] = []  # when each measured step finished
    for it in range(args.steps):
        if it == args.warmup:
            t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        x, y = get_batch()
        _, loss = step_fn(x, y)
        assert loss is not None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it >= args.warmup:
            ends.append(time.perf_counter())
    loss_value = float(loss.detach())
    seconds = time.perf_counter() - t0
    measured = args.steps - args.warmup
    json.dump({"tokens_per_second": measured * B * T / seconds, "loss": loss_value,
               "steps": measured, "seconds": seconds,
               "step_seconds": [b - a for a, b in itertools.pairwise([t0, *ends])]},
              sys.stdout)
    print()


if __name__ == "__main__":
    main()
