"""Gradient compression side by side: bytes, ratio, error, step time and loss per method.

    python bench/compression.py --steps 30

Two CPU ranks on gloo (forked, one thread each) train one small GPT per arm from the same
weights and data order. Arms are interleaved in blocks of steps, in ABBA order (the order
flips every block), so drift in the machine's speed falls on every arm alike. ``none`` runs
twice (an A/A pair): the spread between them is the noise floor for the step-time column.
The first block of each arm is warm-up (DDP's bucket rebuild, PowerSGD's plain all-reduce
steps) and is left out of bytes, error and times. Loss is the validation loss at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from traind.trainer.compression import CommStats, CompressionHook
from traind.trainer.config import CompressionConfig, DataConfig, ModelConfig
from traind.trainer.data import BatchSampler, build_corpus, split_corpus, val_batches
from traind.trainer.model import GPT

WORLD = 2


@dataclass(frozen=True)
class ArmSpec:
    label: str
    method: str
    hook: bool = True  # False: DDP's built-in all-reduce, to price the hook itself
    autocast: bool = False  # bf16 autocast for forward


ARMS = [
    ArmSpec("none", "none"),
    ArmSpec("none (A/A)", "none"),
    ArmSpec("none, DDP built-in", "none", hook=False),
    ArmSpec("none + bf16 autocast", "none", autocast=True),
    ArmSpec("fp16", "fp16"),
    ArmSpec("bf16", "bf16"),
    ArmSpec("int8", "int8"),
    ArmSpec("topk", "topk"),
    ArmSpec("powersgd", "powersgd"),
]


@dataclass
class Arm:
    spec: ArmSpec
    ddp: DDP
    opt: torch.optim.Optimizer
    sampler: BatchSampler
    hook: CompressionHook | None
    times: list[float] = field(default_factory=list)
    stats: list[CommStats] = field(default_factory=list)


def _build(spec: ArmSpec, args: argparse.Namespace, train: torch.Tensor, rank: int) -> Arm:
    torch.manual_seed(0)
    model = GPT(ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4,
                            seq_len=args.seq))
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    hook = None
    if spec.hook:
        hook = CompressionHook(CompressionConfig(
            method=spec.method, powersgd_start_step=args.block))
        hook.register(ddp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sampler = BatchSampler(train, batch_size=args.batch, seq_len=args.seq, seed=0, rank=rank,
                           world_size=WORLD)
    return Arm(spec, ddp, opt, sampler, hook)


def _step(arm: Arm) -> float:
    t0 = time.perf_counter()
    x, y = arm.sampler.next()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=arm.spec.autocast):
        _, loss = arm.ddp(x, y)
    assert loss is not None
    arm.opt.zero_grad(set_to_none=True)
    loss.backward()
    arm.opt.step()
    return time.perf_counter() - t0


def _rank(rank: int, args: argparse.Namespace, store: str, train: torch.Tensor,
          val: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    arms = [_build(spec, args, train, rank) for spec in ARMS]
    blocks = -(-args.steps // args.block)
    for b in range(blocks):
        order = arms if b % 2 == 0 else arms[::-1]  # ABBA: drift falls on every arm alike
        n = min(args.block, args.steps - b * args.block)
        for arm in order:
            times = [_step(arm) for _ in range(n)]
            stats = arm.hook.take_stats() if arm.hook else CommStats()
            if b > 0:  # the first block is warm-up
                arm.times += times
                arm.stats.append(stats)
    rows = []
    for arm in arms:
        with torch.no_grad():
            losses = [float(arm.ddp.module(x, y)[1]) for x, y in val]
        rows.append((arm, sum(losses) / len(losses)))
    if rank == 0:
        _print(rows, args)
    dist.destroy_process_group()


def _print(rows: list[tuple[Arm, float]], args: argparse.Namespace) -> None:
    none_loss = rows[0][1]
    none_time = statistics.median(rows[0][0].times)
    print(f"\n{WORLD} gloo ranks x 1 thread, GPT d_model {args.d_model} x {args.layers} layers, "
          f"seq {args.seq}, batch {args.batch}/rank, {args.steps} steps in blocks of "
          f"{args.block} (first block = warm-up, left out); bucket {args.bucket_mb} MiB")
    head = (f"{'arm':22} {'sent/step':>10} {'ratio':>7} {'rel err':>8} {'step ms':>8} "
            f"{'vs none':>8} {'hook ms':>8} {'coll ms':>8} {'val loss':>9} {'Δ loss':>7}")
    print(head)
    print("-" * len(head))
    for arm, loss in rows:
        steps = sum(s.steps for s in arm.stats)
        raw = sum(s.raw_bytes for s in arm.stats)
        sent = sum(s.sent_bytes for s in arm.stats)
        med = statistics.median(arm.times)
        if steps:
            # one number from the windows' errors: the mean (windows are equally long)
            err = statistics.mean(s.rel_error for s in arm.stats)
            hook_ms = 1e3 * sum(s.hook_seconds for s in arm.stats) / steps
            coll_ms = 1e3 * sum(s.allreduce_seconds for s in arm.stats) / steps
            cols = (f"{sent / steps / 1e6:9.3f}M {raw / sent:7.2f} {err:8.4f}",
                    f"{hook_ms:8.2f} {coll_ms:8.2f}")
        else:
            cols = (f"{'-':>10} {'-':>7} {'-':>8}", f"{'-':>8} {'-':>8}")
        print(f"{arm.spec.label:22} {cols[0]} {1e3 * med:8.1f} {med / none_time:7.2f}x "
              f"{cols[1]} {loss:9.4f} {loss - none_loss:+7.4f}")
    aa = statistics.median(rows[1][0].times)
    print(f"\nA/A: none vs none (A/A) median step time differ by "
          f"{100 * abs(aa - none_time) / none_time:.1f}% (the noise floor of 'vs none'); "
          f"val loss differs by {abs(rows[1][1] - none_loss):.2g}.")
    print("sent/step: bytes this rank put on the wire (ring algorithm); ratio: raw/sent; "
          "rel err: local ||C(x)-x||/||x|| (powersgd: against the averaged result, so it "
          "includes rank disagreement); coll ms: waiting in collectives.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per arm")
    ap.add_argument("--block", type=int, default=10, help="steps per interleaved block")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (MiB)")
    args = ap.parse_args()
    if args.steps <= args.block:
        ap.error("--steps must exceed --block: the first block is warm-up")
    corpus = build_corpus(DataConfig(max_bytes=2_000_000))
    train, val_data = split_corpus(corpus, 0.05, seq_len=args.seq)
    val = val_batches(val_data, batch_size=args.batch, seq_len=args.seq, n_batches=4)
    with tempfile.TemporaryDirectory() as tmp:
        # fork: CPU only, nothing has touched CUDA; a spawned rank would re-import torch
        mp.start_processes(_rank, args=(args, str(Path(tmp) / "store"), train, val),
                           nprocs=WORLD, start_method="fork")


if __name__ == "__main__":
    main()
