"""Mesh layouts (dp x tp x pp) against data parallel alone on the same CPU ranks, as real jobs.

    python bench/parallel.py --ranks 4                   # 11 layouts x 3 rounds, ~11 min on 2 cores
    python bench/parallel.py --ranks 8 --rounds 3        # 6 layouts, ~12 min
    python bench/parallel.py --ranks 4 --layout "dp2 tp2" --layout "tp2 pp2 1f1b"

Every block is one job exactly as ``traind run`` starts it (torchrun, trainer/worker.py; events
to a file), of the same model and the same global batch: each dp group reads
``--batch / dp`` sequences per step, so every layout does the same work per step. Per job:

- ``tok/s``: the global batch's tokens over the median step (rank 0's step events after
  ``--warmup``); ``ratio``: to the dp-only baseline of the same round (paired), with its 95%
  interval; the baseline runs first and last in each round (an A/A pair: this machine's noise
  at this moment, printed beside).
- ``peak RSS``: the largest rank's peak resident memory (the finished event's
  ``peak_memory``; on CPU the tensors live there, beside the torch runtime that is most of it
  at this size).
- ``opt state``: the largest rank's AdamW state (the finished event's
  ``optimizer_state_bytes``): what zero1, fsdp and hsdp shard over dp, and tp over its ranks.
- ``bubble``: a pipeline's stage-0 idle share of its step (median over steps, host time),
  beside the schedule's theory ``(p-1)/(v m + p-1)``.

Rounds run the layouts in an order reversed every other round, so the machine's drift falls on
all alike. The ranks share this machine's 2 cores: the figures are of loopback gloo on an
oversubscribed CPU, where tensor parallel's per-layer collectives cost far more than over
NVLink; only their ratios on this machine mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traind.contracts.events import LifecycleEvent, PipelineEvent, StepEvent, decode_complete
from traind.daemon.experiments.stats import speedup

MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64}
# name -> parallel section; the first of each world size is the baseline
LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    4: {"dp4": {},
        "dp4 zero1": {"strategy": "zero1"},
        "dp4 fsdp": {"strategy": "fsdp"},
        "dp4 hsdp 2x2": {"strategy": "hsdp", "dp_shard": 2},
        "dp2 tp2": {"tp": 2, "strategy": "fsdp"},
        "dp2 tp2 ddp": {"tp": 2},
        "dp2 tp2 zero1": {"tp": 2, "strategy": "zero1"},
        "pp2 dp2 gpipe": {"pp": 2, "pp_schedule": "gpipe"},
        "pp2 dp2 1f1b": {"pp": 2, "pp_schedule": "1f1b"},
        "pp2 dp2 1f1b zero1": {"pp": 2, "pp_schedule": "1f1b", "strategy": "zero1"},
        "tp2 pp2 1f1b": {"tp": 2, "pp": 2, "pp_schedule": "1f1b"},
        "tp2 pp2 interleaved": {"tp": 2, "pp": 2, "pp_schedule": "interleaved_1f1b"}},
    8: {"dp8": {},
        "dp4 tp2": {"tp": 2, "strategy": "fsdp"},
        "dp4 tp2 hsdp 2x2": {"tp": 2, "strategy": "hsdp", "dp_shard": 2},
        "pp2 dp4 1f1b": {"pp": 2, "pp_schedule": "1f1b"},
        "dp2 tp2 pp2 1f1b": {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "strategy": "fsdp"},
        "dp2 tp2 pp2 gpipe": {"tp": 2, "pp": 2, "pp_schedule": "gpipe", "strategy": "fsdp"}},
}


@dataclass(frozen=True, slots=True)
class Block:
    tokens_per_second: float
    peak_rss: float  # bytes, the largest rank's
    optimizer_state: int  # bytes of AdamW state, the largest rank's (deterministic)
    bubble: float | None  # stage 0's measured idle share, median over steps
    theory: float | None


def job_config(out: Path, parallel: dict[str, Any], *, ranks: int, batch: int, steps: int,
               microbatches: int) -> dict[str, Any]:
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    dp = ranks // (tp * pp)
    return {
        "job": {"steps": steps, "batch_size": batch // dp, "threads": 1, "out_dir": str(out),
                "nproc_per_node": ranks, "eval_every": 10**9, "checkpoint_every": 10**9,
                "resume": False, "seed": 1},
        "model": MODEL,
        "data": {"max_bytes": 400_000},
        "telemetry": {"per_layer": False},
        "parallel": {**parallel, **({"microbatches": microbatches} if pp > 1 else {})},
    }


def run_block(parallel: dict[str, Any], args: argparse.Namespace) -> Block:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cfg = job_config(out, parallel, ranks=args.ranks, batch=args.batch, steps=args.steps,
                         microbatches=args.microbatches)
        (out / "config.json").write_text(json.dumps(cfg))
        with open(out / "log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={args.ranks}", "--max_restarts=0", "-m",
                 "traind.trainer.worker", "--config", str(out / "config.json"),
                 "--events-file", str(out / "events")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(900)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        if code:
            raise SystemExit(f"job {parallel} failed:\n{(out / 'log').read_text()[-3000:]}")
        ranks = [decode_complete((out / f"events.rank{r}").read_bytes())
                 for r in range(args.ranks)]
    steps = [e.step_seconds for e in ranks[0]
             if isinstance(e, StepEvent) and e.step > args.warmup]
    tokens = args.batch * MODEL["seq_len"]  # the global batch: every dp group's
    finished = [e for events in ranks for e in events
                if isinstance(e, LifecycleEvent) and e.phase == "finished"]
    pipe = [e for e in ranks[0] if isinstance(e, PipelineEvent) and e.step > args.warmup]
    return Block(tokens / statistics.median(steps),
                 max(e.detail["peak_memory"]["host_rss"] for e in finished),
                 max(e.detail["optimizer_state_bytes"] for e in finished),
                 statistics.median(e.bubble for e in pipe) if pipe else None,
                 pipe[0].bubble_theory if pipe else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, choices=sorted(LAYOUTS), default=4)
    p.add_argument("--layout", action="append", help="a layout's name (repeatable; default "
                   "all of --ranks'); the dp-only baseline always runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of each block")
    p.add_argument("--batch", type=int, default=16, help="the global batch (sequences)")
    p.add_argument("--microbatches", type=int, default=4, help="a pipeline's micro-batches")
    args = p.parse_args()
    table = LAYOUTS[args.ranks]
    base, *others = table
    chosen = [n for n in others if not args.layout or n in args.layout]
    if args.layout and (bad := set(args.layout) - set(table)):
        p.error(f"--layout: {sorted(bad)} not among {list(table)}")
    if args.rounds < 2:
        p.error("--rounds: at least 2 (the interval needs pairs)")

    blocks: dict[str, list[Block]] = {n: [] for n in [base, *chosen]}
    aa: list[float] = []  # each round's last baseline over its first
    t0 = time.monotonic()
    for r in range(args.rounds):
        order = chosen if r % 2 == 0 else chosen[::-1]
        first = run_block(table[base], args)
        for name in order:
            blocks[name].append(run_block(table[name], args))
            print(f"round {r + 1}/{args.rounds} {name:22s} "
                  f"{blocks[name][-1].tokens_per_second:9.0f} tok/s", flush=True)
        last = run_block(table[base], args)
        aa.append(last.tokens_per_second / first.tokens_per_second)
        # the round's baseline: the mean of its two runs, each layout's pair
        blocks[base].append(Block((first.tokens_per_second + last.tokens_per_second) / 2,
                                  max(first.peak_rss, last.peak_rss),
                                  first.optimizer_state, None, None))

    base_tps = [b.tokens_per_second for b in blocks[base]]
    print(f"\n{args.ranks} CPU ranks, global batch {args.batch} x {MODEL['seq_len']} tokens, "
          f"model {MODEL}, {args.rounds} rounds, {time.monotonic() - t0:.0f} s")
    print(f"{'layout':22s} {'tok/s':>8s} {'ratio':>7s} {'95% CI':>15s} {'peak RSS':>10s} "
          f"{'opt state':>10s} {'bubble':>7s} {'theory':>7s}")
    for name in [base, *chosen]:
        runs = blocks[name]
        tps = [b.tokens_per_second for b in runs]
        ratio = (speedup(base_tps, tps, paired=True) if name != base else None)
        ci = f"[{ratio.low:.2f}, {ratio.high:.2f}]" if ratio else ""
        bubble = [b.bubble for b in runs if b.bubble is not None]
        pipe = (f"{statistics.median(bubble):7.2f} {runs[0].theory:7.2f}"
                if bubble and runs[0].theory is not None else "")
        print(f"{name:22s} {statistics.median(tps):8.0f} "
              f"{(ratio.ratio if ratio else 1.0):7.2f} {ci:>15s} "
              f"{max(b.peak_rss for b in runs) / 2**20:7.0f} MiB "
              f"{runs[0].optimizer_state / 2**20:6.2f} MiB {pipe}")
    print(f"{'A/A: ' + base + ' last/first':22s} {'':8s} {statistics.median(aa):7.2f} "
          f"{f'[{min(aa):.2f}, {max(aa):.2f}]':>15s}  (min..max over rounds)")


if __name__ == "__main__":
    main()
