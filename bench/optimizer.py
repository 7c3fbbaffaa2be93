"""AdamW's kernels side by side: fused against foreach (multi-tensor) on this machine's CPU.

    python bench/optimizer.py                       # the speed bench's model (~5M parameters)
    python bench/optimizer.py --d-model 512 --layers 8

Both optimizers step the same parameters with the same gradients in one process, a block of
steps each in turn (A B A B ...), so the machine's drift falls on both alike. Printed: each
kernel's median step in ms (the median of its blocks' medians), the ratio foreach / fused with
its 95% interval (paired by turn), and an A/A line (foreach's even blocks against its odd
ones), this machine's noise at this moment.
Why it matters: ``trainer/optim.adamw_kernel`` picks the kernel from this table; at the speed
bench's shape a training step is ~1.2 s here, so the difference is a share of every step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from traind.daemon.experiments.stats import speedup
from traind.trainer.config import ModelConfig
from traind.trainer.model import GPT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="blocks per kernel")
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="blocks left out")
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=8, seq_len=256))
    params = list(model.parameters())
    for q in params:
        q.grad = torch.randn_like(q)

    def adamw(**kernel: bool) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            [{"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
             {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
            lr=1e-3, betas=(0.9, 0.95), **kernel)

    kernels = {"foreach": adamw(foreach=True), "fused": adamw(fused=True)}
    seconds: dict[str, list[float]] = {k: [] for k in kernels}
    # Blocks of --block steps per kernel, in turn (A B A B ...), the first step of each left
    # out: each optimizer has its own 40 MB of moments, and stepping the two by turns per
    # step made each start from a cache the other had just emptied (foreach then read 10x
    # slower than fused, against ~1.5x inside a training loop)
    for _ in range(args.warmup + args.steps):
        for name, opt in kernels.items():
            for i in range(args.block + 1):
                t0 = time.perf_counter()
                opt.step()
                if i:
                    seconds[name].append(time.perf_counter() - t0)
    blocks = {name: [statistics.median(times[i:i + args.block])
                     for i in range(0, len(times), args.block)]
              for name, times in seconds.items()}
    fused, foreach = blocks["fused"][args.warmup:], blocks["foreach"][args.warmup:]
    n = sum(q.numel() for q in params)
    print(f"AdamW step, {n / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, "
          f"{args.steps} blocks of {args.block} steps")
    for name, times in (("foreach", foreach), ("fused", fused)):
        print(f"  {name:8s} {statistics.median(times) * 1e3:8.2f} ms")
    # speedup() compares rates: a step's rate is 1 / its seconds
    iv = speedup([1 / s for s in foreach], [1 / s for s in fused], paired=True)
    print(f"  fused is {iv.ratio:.2f}x foreach [{iv.low:.2f}, {iv.high:.2f}]")
    even, odd = foreach[0::2], foreach[1::2]
    n_pairs = min(len(even), len(odd))
    aa = speedup([1 / s for s in even[:n_pairs]], [1 / s for s in odd[:n_pairs]], paired=True)
    print(f"  A/A (foreach, alternate blocks) {aa.ratio:.2f}x [{aa.low:.2f}, {aa.high:.2f}]")


if __name__ == "__main__":
    main()
