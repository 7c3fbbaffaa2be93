"""The data loader: tokens/s it can feed, and the training step's wait for data (issue 18).

    python bench/data.py                        # prepares the default corpus (bytes) first
    python bench/data.py --shards DIR --rounds 3 --steps 40

**Feed rate.** Batches of the speed bench's shape (16 x 256) drawn from the prepared shards as
fast as the pipeline gives them, nothing else running: cold (the shards' pages evicted from the
page cache first, so tier 3 reads from disk) and warm, with ``data.prefetch`` 0 and 2. Printed:
tokens/s and each tier's hits and misses.

**Wait share.** ``train()`` of the speed bench's model (6 layers, d_model 256, 8 heads, seq
256, batch 16) on the shards, in this process, one run per arm per round, arms in an order
reversed every other round. The wait share is the data wait the pipeline measured
(``prefetch_wait_seconds``, the loop's ``next()``) over the steps' summed seconds, after
``--warmup`` steps. Goal: < 1% of step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from traind.contracts.events import DataEvent, StepEvent
from traind.data.prepare import prepare
from traind.data.tokenizer import ByteTokenizer
from traind.trainer.config import DataConfig, FilterConfig, TrainConfig
from traind.trainer.loop import train
from traind.trainer.pipeline import DataPipeline
from traind.trainer.sink import ListSink

SHAPE = {"n_layers": 6, "d_model": 256, "n_heads": 8, "seq_len": 256}
BATCH = 16


def evict(folder: Path) -> None:
    for shard in folder.glob("*.bin"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def feed_rate(shards: Path, *, prefetch: int, cold: bool, batches: int) -> tuple[float, str]:
    if cold:
        evict(shards)
    cfg = DataConfig(shards=shards, prefetch=prefetch)
    with DataPipeline.build(cfg, batch_size=BATCH, seq_len=SHAPE["seq_len"], seed=0) as p:
        p.next()  # starts the thread
        t0 = time.perf_counter()
        for _ in range(batches):
            p.next()
        seconds = time.perf_counter() - t0
        hits, misses, _ = p.tiers.snapshot()
    tiers = ", ".join(f"{t} {hits[t]}/{hits[t] + misses[t]}" for t in hits)
    return batches * BATCH * SHAPE["seq_len"] / seconds, tiers


def wait_share(shards: Path, *, prefetch: int, steps: int, warmup: int) -> tuple[float, float]:
    cfg = TrainConfig.model_validate({
        "job": {"steps": steps, "batch_size": BATCH, "threads": 0, "eval_every": 10**6,
                "checkpoint_every": 10**6, "out_dir": tempfile.mkdtemp(prefix="bench-data-")},
        "model": SHAPE, "data": {"shards": str(shards), "prefetch": prefetch},
        "telemetry": {"every": 1}})
    sink = ListSink()
    train(cfg, sink)
    step_seconds = sum(e.step_seconds for e in sink.events
                       if isinstance(e, StepEvent) and e.step > warmup)
    data = [e for e in sink.events if isinstance(e, DataEvent)]
    at_warmup = next(e for e in data if e.step >= warmup)
    waited = data[-1].prefetch_wait_seconds - at_warmup.prefetch_wait_seconds
    tokens_per_s = (steps - warmup) * BATCH * SHAPE["seq_len"] / step_seconds
    return waited / step_seconds, tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=Path, help="a prepared folder (default: prepare the "
                    "default corpus with the byte tokenizer into a temporary folder)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batches", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    shards = args.shards
    if shards is None:
        shards = Path(tempfile.mkdtemp(prefix="bench-shards-"))
        t0 = time.perf_counter()
        m = prepare([], shards, filter_cfg=FilterConfig(), tokenizer=ByteTokenizer())
        print(f"prepared the default corpus: {m.tokens('train'):,} train tokens in "
              f"{time.perf_counter() - t0:.1f} s -> {shards}", file=sys.stderr)

    print("| loader | prefetch | tokens/s | tier hits/requests |")
    print("| --- | --- | --- | --- |")
    for cold in (True, False):
        for prefetch in (0, 2):
            rate, tiers = feed_rate(shards, prefetch=prefetch, cold=cold, batches=args.batches)
            print(f"| {'cold' if cold else 'warm'} | {prefetch} | {rate:,.0f} | {tiers} |")

    arms = (0, 2)
    shares: dict[int, list[float]] = {a: [] for a in arms}
    speeds: dict[int, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for prefetch in arms if r % 2 == 0 else arms[::-1]:
            share, speed = wait_share(shards, prefetch=prefetch, steps=args.steps,
                                      warmup=args.warmup)
            shares[prefetch].append(share)
            speeds[prefetch].append(speed)
            print(f"round {r + 1} prefetch {prefetch}: wait {share:.3%} of step time, "
                  f"{speed:,.0f} tokens/s", file=sys.stderr)
    print()
    print("| training, data.prefetch | data wait / step time (per round) | median | "
          "tokens/s (median) | goal < 1% |")
    print("| --- | --- | --- | --- | --- |")
    for a in arms:
        med = statistics.median(shares[a])
        print(f"| {a} | {', '.join(f'{s:.3%}' for s in shares[a])} | {med:.3%} | "
              f"{statistics.median(speeds[a]):,.0f} | {'pass' if med < 0.01 else 'FAIL'} |")


if __name__ == "__main__":
    main()
