"""Gradient compression side by side at 2, 4 and 8 ranks: bytes, bus bandwidth, step time.

    python bench/compression.py                       # N = 2, 4, 8; a few minutes on 2 cores
    python bench/compression.py --worlds 2 --steps 30 --val   # also the validation loss

For each world size N, N CPU ranks on gloo (forked, one thread each) train one small GPT per
method from the same weights and data order, through the one asynchronous hook path. Arms
are interleaved in blocks of steps in ABBA order (the order flips every block), so drift in
the machine's speed falls on every arm alike; ``none`` runs twice (an A/A pair): the spread
between them is the noise floor of the step-time column. The first block of each arm is
warm-up (DDP's bucket rebuild, PowerSGD's plain all-reduce steps) and is left out.

Columns, per method and N:
- ``sent/step``: bytes one rank put on the wire per step, all collectives, each under its
  ring algorithm (``_math.WIRE_BYTES``); ``vs fp32``: that over the fp32 all-reduce's
  (``none``) at the same N. The two-phase int8 stays ~0.25 at any N; an all-gather scheme
  would grow as (N-1) x payload.
- ``ops``: the collectives a step issues, by op (PowerSGD's vector, P and Q all-reduces
  count one by one).
- ``algbw`` / ``busbw``: nccl-tests' definitions over all the method's calls: algbw = S / t
  with S the collective's size (all-reduce and all-to-all: the input; all-gather: the
  output), busbw = algbw x the op's factor (all-reduce 2(N-1)/N, all-gather and all-to-all
  (N-1)/N, ``metrics.arithmetic.BUS_FACTORS``). Summed over calls: sum(S·factor)/sum(t).
  On one machine the ranks share 2 cores, so these are loopback figures, not a network's.
- ``coll ms``: the time some gradient collective was in flight per step (the union of
  intervals, the ``traind_comm_allreduce_seconds`` figure); ``step ms``: median step time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from traind.metrics.arithmetic import BUS_FACTORS, nccl_size
from traind.trainer.compression import CommStats, CompressionHook
from traind.trainer.config import CompressionConfig, DataConfig, ModelConfig
from traind.trainer.data import BatchSampler, build_corpus, split_corpus, val_batches
from traind.trainer.model import GPT

ARMS = [("none", "none"), ("none (A/A)", "none"), ("fp16", "fp16"), ("bf16", "bf16"),
        ("int8", "int8"), ("topk", "topk"), ("powersgd", "powersgd")]


@dataclass
class Arm:
    label: str
    ddp: DDP
    opt: torch.optim.Optimizer
    sampler: BatchSampler
    hook: CompressionHook
    times: list[float] = field(default_factory=list)
    stats: list[CommStats] = field(default_factory=list)


def _build(label: str, method: str, args: argparse.Namespace, train: torch.Tensor, rank: int,
           world: int) -> Arm:
    torch.manual_seed(0)
    model = GPT(ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4,
                            seq_len=args.seq))
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    hook = CompressionHook(CompressionConfig(method=method, powersgd_start_step=args.block))
    hook.register(ddp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sampler = BatchSampler(train, batch_size=args.batch, seq_len=args.seq, seed=0, rank=rank,
                           world_size=world)
    return Arm(label, ddp, opt, sampler, hook)


def _step(arm: Arm) -> float:
    t0 = time.perf_counter()
    x, y = arm.sampler.next()
    _, loss = arm.ddp(x, y)
    assert loss is not None
    arm.opt.zero_grad(set_to_none=True)
    loss.backward()
    arm.opt.step()
    return time.perf_counter() - t0


def _bus(stats: list[CommStats], world: int) -> tuple[float, float, dict[str, int]]:
    """(algbw, busbw) in bytes/s over every call of the windows, and calls by op."""
    size = bus = seconds = 0.0
    calls: dict[str, int] = {}
    for s in stats:
        for c in s.collectives:
            total = nccl_size(c["op"], c["bytes"], world)  # nccl-tests' S
            size += total
            bus += total * BUS_FACTORS[c["op"]](world)
            seconds += c["seconds"]
            calls[c["op"]] = calls.get(c["op"], 0) + c["calls"]
    return (size / seconds, bus / seconds, calls) if seconds > 0 else (0.0, 0.0, calls)


def _rank(rank: int, world: int, args: argparse.Namespace, store: str, train: torch.Tensor,
          val: list[tuple[torch.Tensor, torch.Tensor]], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    arms = [_build(label, method, args, train, rank, world) for label, method in ARMS]
    blocks = -(-args.steps // args.block)
    for b in range(blocks):
        order = arms if b % 2 == 0 else arms[::-1]  # ABBA: drift falls on every arm alike
        n = min(args.block, args.steps - b * args.block)
        for arm in order:
            times = [_step(arm) for _ in range(n)]
            stats = arm.hook.take_stats()
            if b > 0:  # the first block is warm-up
                arm.times += times
                arm.stats.append(stats)
    rows: list[dict[str, Any]] = []
    for arm in arms:
        steps = sum(s.steps for s in arm.stats)
        algbw, busbw, calls = _bus(arm.stats, world)
        loss = float("nan")
        if args.val:
            with torch.no_grad():
                loss = sum(float(arm.ddp.module(x, y)[1]) for x, y in val) / len(val)
        rows.append({
            "label": arm.label, "world": world, "steps": steps,
            "sent": sum(s.sent_bytes for s in arm.stats) / steps,
            "raw": sum(s.raw_bytes for s in arm.stats) / steps,
            "err": statistics.mean(s.rel_error for s in arm.stats),
            "calls": {op: c / steps for op, c in calls.items()},
            "algbw": algbw, "busbw": busbw,
            "coll_ms": 1e3 * sum(s.allreduce_seconds for s in arm.stats) / steps,
            "step_ms": 1e3 * statistics.median(arm.times), "loss": loss})
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\ngloo ranks x 1 thread on one machine, GPT d_model {args.d_model} x {args.layers} "
          f"layers, seq {args.seq}, batch {args.batch}/rank, {args.steps} steps per arm in "
          f"blocks of {args.block} (first block = warm-up, left out); bucket {args.bucket_mb} "
          "MiB; async hook path")
    head = (f"{'N':>2} {'method':11} {'sent/step':>10} {'vs fp32':>8} {'raw/sent':>8} "
            f"{'rel err':>8} {'ops per step':24} {'algbw':>9} {'busbw':>9} {'coll ms':>8} "
            f"{'step ms':>8}" + (f" {'val loss':>8}" if args.val else ""))
    print(head)
    print("-" * len(head))
    for world in sorted({r["world"] for r in rows}):
        at = [r for r in rows if r["world"] == world]
        fp32 = at[0]["sent"]
        for r in at:
            ops = " ".join(f"{op.replace('all_', '')}:{c:g}" for op, c in sorted(
                r["calls"].items()))
            print(f"{world:2} {r['label']:11} {r['sent'] / 1e6:9.4f}M {r['sent'] / fp32:8.3f} "
                  f"{r['raw'] / r['sent']:8.2f} {r['err']:8.4f} {ops:24} "
                  f"{r['algbw'] / 1e9:7.3f}G/s {r['busbw'] / 1e9:7.3f}G/s {r['coll_ms']:8.2f} "
                  f"{r['step_ms']:8.1f}" + (f" {r['loss']:8.4f}" if args.val else ""))
        aa = abs(at[1]["step_ms"] - at[0]["step_ms"]) / at[0]["step_ms"]
        print(f"   A/A at N={world}: none vs none step time differ by {100 * aa:.1f}% "
              "(the noise floor of step ms)")
    print("sent/step: bytes one rank sends per step; vs fp32: over none's at the same N; "
          "rel err: local ||C(x)-x||/||x||; coll ms: collectives in flight (union) per step.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=16, help="training steps per arm")
    ap.add_argument("--block", type=int, default=4, help="steps per interleaved block")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket size (MiB)")
    ap.add_argument("--val", action="store_true", help="also the validation loss at the end")
    args = ap.parse_args()
    if args.steps <= args.block:
        ap.error("--steps must exceed --block: the first block is warm-up")
    corpus = build_corpus(DataConfig(max_bytes=2_000_000))
    train, val_data = split_corpus(corpus, 0.05, seq_len=args.seq)
    val = val_batches(val_data, batch_size=args.batch, seq_len=args.seq, n_batches=4)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = str(Path(tmp) / f"rows{world}.pt")
            # fork: CPU only, nothing has touched CUDA; a spawned rank would re-import torch
            mp.start_processes(_rank, args=(world, args, str(Path(tmp) / f"store{world}"),
                                            train, val, out), nprocs=world, start_method="fork")
            rows += torch.load(out)
    _print(rows, args)


if __name__ == "__main__":
    main()
