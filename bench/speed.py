"""traind's trainer against a bare training loop of the same shape, side by side.

    python bench/speed.py --rounds 4 --steps 30                      # default traind vs bare
    python bench/speed.py --arm traind --arm "traind:data.prefetch=0" --arm bare:compile \\
        --arm "traind:job.compile=true"

Arms (``--arm``, repeatable; the first ``bare`` arm is the baseline):

- ``bare`` / ``bare:compile`` / ``bare:compile-blocks`` / ``bare:fused``:
  ``bench/bare_loop.py`` in its own process (no telemetry, no threads); ``compile``: with
  ``torch.compile(model)``; ``compile-blocks``: traind's per-block compile
  (``trainer/compile.py``) instead; ``fused``: with AdamW's
  fused kernel, as traind takes it (``bare`` uses foreach).
- ``bare:torchrun``: the bare loop launched as traind launches a worker (``torch.distributed.run
  --standalone --nproc_per_node=1``): what the launcher alone costs.
- ``inproc[:key=value;...]``: traind's ``train()`` in a fresh process of its own, no torchrun,
  events kept in a list (no socket, no decoding): the trainer's loop alone. With ``bare``,
  ``bare:torchrun`` and ``traind`` it splits traind's gap to the bare loop into the launcher,
  the loop, and the events' way to the daemon.
- ``traind[:key=value;key=value]``: ``traind run``'s path exactly: the daemon's ``Job``
  launches the worker through torchrun, events cross the Unix socket to this process, which
  decodes every one (as ``traind run`` does, less the progress bar), with the default
  configuration except for the shape below and the ``key=value`` overrides (config paths as
  ``--set`` takes them). Evaluation and checkpoints are moved past the run: the bare loop
  has neither, and the comparison is of training steps.

Every block is a fresh process of ``--steps`` steps; its figure is tokens/s over the steps
after ``--warmup`` (the compile, the allocator and the first steps fall inside the warm-up).
A second table gives each block's median step instead: this machine's neighbours slow whole
seconds at a time (steps of one block here ranged 1.3-2.3 s), which the block figure carries
and the median step does not; work done every k-th step only (per-layer norms) shows in the
block figure alone.
Each round runs every arm once, in an order reversed every other round (A B C, C B A, ...),
so the machine's drift falls on all arms alike; a round's ratio is arm / baseline within the
round (paired). The A/A line pairs the baseline with itself in adjacent rounds: the noise
floor of this machine at this moment. Shape: 6 layers, d_model 256, 8 heads, seq 256,
batch 16 (the issue's).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from traind.contracts.events import Event, StepEvent
from traind.daemon.config import assign, parse_value
from traind.daemon.experiments.stats import speedup
from traind.daemon.runs.jobs import Job
from traind.metrics.throughput import Window
from traind.trainer.config import TrainConfig

HERE = Path(__file__).resolve().parent
SHAPE = {"n_layers": 6, "d_model": 256, "n_heads": 8, "seq_len": 256}
BATCH = 16


def traind_config(steps: int, overrides: str) -> TrainConfig:
    tree: dict[str, Any] = {
        "job": {"steps": steps, "batch_size": BATCH, "eval_every": 10**9,
                "checkpoint_every": 10**9, "resume": False},
        "model": dict(SHAPE),
    }
    for item in filter(None, overrides.split(";")):  # as ``traind run --set`` reads them
        key, _, raw = item.partition("=")
        assign(tree, key.strip().split("."), parse_value(raw.strip()), source=f"--arm {item}")
    return TrainConfig.model_validate(tree)


def run_job(cfg: TrainConfig) -> list[Event]:
    """Train ``cfg`` as ``traind run`` does (the daemon's Job: torchrun, the worker, events over
    the Unix socket) in a temporary out_dir; every event, in arrival order."""
    events: list[Event] = []

    async def go() -> None:
        with tempfile.TemporaryDirectory(prefix="traind-speed-") as tmp:
            run_cfg = cfg.model_copy(update={"job": cfg.job.model_copy(
                update={"out_dir": Path(tmp)})})
            job = Job(run_cfg, Path(tmp), events.append)
            await job.start()
            exit_ = await job.wait()
            if exit_.code != 0:
                raise RuntimeError(f"traind run failed: {exit_.describe()}\n"
                                   + job.log_path.read_text()[-3000:])

    asyncio.run(go())
    return events


def throughput(events: list[Event], warmup: int) -> float:
    """Tokens/s of one rank over the steps after ``warmup``, from the step reports' clocks."""
    timed = [e for e in events if isinstance(e, StepEvent) and e.step >= warmup]
    if len(timed) < 2:
        raise ValueError(f"fewer than 2 step reports after step {warmup}")
    window = Window()  # metrics/throughput's ratio of totals: the figure the daemon exports
    for a, b in itertools.pairwise(timed):
        window.add(b.tokens * b.steps, b.time - a.time)
    if window.tokens_per_second is None:
        raise ValueError(f"no timed step reports after step {warmup}")
    return window.tokens_per_second


def median_step_rate(events: list[Event], warmup: int) -> float:
    """Tokens/s of one rank's median report interval after ``warmup`` (each interval's tokens
    over its seconds): a typical step, which a burst of the machine's noise does not move."""
    timed = [e for e in events if isinstance(e, StepEvent) and e.step >= warmup]
    if len(timed) < 2:
        raise ValueError(f"fewer than 2 step reports after step {warmup}")
    return statistics.median(b.tokens * b.steps / (b.time - a.time)
                             for a, b in itertools.pairwise(timed))


def run_traind(steps: int, warmup: int, overrides: str) -> tuple[float, float]:
    events = run_job(traind_config(steps, overrides))
    return throughput(events, warmup), median_step_rate(events, warmup)


def run_inproc(steps: int, warmup: int, overrides: str) -> tuple[float, float]:
    """``train()`` in a child process (this script's ``--inproc``): its events come back as
    the two figures."""
    cmd = [sys.executable, __file__, "--inproc", overrides, "--steps", str(steps),
           "--warmup", str(warmup)]
    figures = child_figures(cmd)
    return float(figures["block"]), float(figures["median"])


def child_figures(cmd: list[str]) -> dict[str, Any]:
    """Run a bench child (``bare_loop.py``, ``--inproc``): the JSON line it prints last."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def inproc_main(steps: int, warmup: int, overrides: str) -> None:
    """The ``inproc`` arm's child: train in this process, print the figures as one JSON line."""
    from traind.trainer.loop import train
    from traind.trainer.sink import ListSink

    cfg = traind_config(steps, overrides)
    sink = ListSink()
    with tempfile.TemporaryDirectory(prefix="traind-speed-") as tmp:
        train(cfg.model_copy(update={"job": cfg.job.model_copy(update={"out_dir": Path(tmp)})}),
              sink)
    print(json.dumps({"block": throughput(sink.events, warmup),
                      "median": median_step_rate(sink.events, warmup)}))


def run_bare(steps: int, warmup: int, option: str) -> tuple[float, float]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [sys.executable, *(launcher if option == "torchrun" else []),
           str(HERE / "bare_loop.py"), "--steps", str(steps), "--warmup",
           str(warmup), "--layers", str(SHAPE["n_layers"]), "--d-model", str(SHAPE["d_model"]),
           "--heads", str(SHAPE["n_heads"]), "--seq", str(SHAPE["seq_len"]),
           "--batch", str(BATCH)] + ([f"--{option}"] if option not in ("", "torchrun") else [])
    figures = child_figures(cmd)
    typical = BATCH * SHAPE["seq_len"] / statistics.median(figures["step_seconds"])
    return float(figures["tokens_per_second"]), typical


def run_arm(arm: str, steps: int, warmup: int) -> tuple[float, float]:
    """An arm's block figure (tokens/s over the measured steps) and its median step's."""
    kind, _, rest = arm.partition(":")
    if kind == "bare" and rest in ("", "compile", "compile-blocks", "fused", "torchrun"):
        return run_bare(steps, warmup, rest)
    if kind == "traind":
        return run_traind(steps, warmup, rest)
    if kind == "inproc":
        return run_inproc(steps, warmup, rest)
    raise SystemExit(f"--arm: {arm!r} is neither bare[:compile|compile-blocks|fused|torchrun], "
                     "inproc[:k=v;...] nor traind[:k=v;...]")


def print_table(title: str, arms: list[str], figures: dict[str, list[float]]) -> None:
    """Each arm's ratio to the bare baseline (paired by round), and the baseline's A/A."""
    base = figures["bare"]
    print(f"\n{title}\n{'arm (vs bare, paired by round)':44s} {'median tok/s':>12s} "
          f"{'ratio':>7s} {'95% CI':>17s}")
    for arm in arms:
        if arm == "bare":
            continue
        iv = speedup(base, figures[arm], paired=True)
        print(f"{arm:44s} {statistics.median(figures[arm]):12.0f} {iv.ratio:7.3f} "
              f"[{iv.low:.3f}, {iv.high:.3f}]")
    aa = speedup(base[:-1], base[1:], paired=True)
    print(f"{'A/A: bare, adjacent rounds':44s} {statistics.median(base):12.0f} "
          f"{aa.ratio:7.3f} [{aa.low:.3f}, {aa.high:.3f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", action="append",
                   help="bare, bare:compile, bare:compile-blocks, bare:fused, bare:torchrun, "
                   "inproc[:k=v;k=v], traind[:k=v;k=v]")
    p.add_argument("--inproc", metavar="OVERRIDES", help=argparse.SUPPRESS)  # the arm's child
    p.add_argument("--rounds", type=int, default=4, help="rounds (each runs every arm once)")
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--warmup", type=int, default=8, help="steps left out of each block")
    args = p.parse_args()
    if args.inproc is not None:
        inproc_main(args.steps, args.warmup, args.inproc)
        return
    arms = args.arm or ["traind"]
    if "bare" not in arms:
        arms = ["bare", *arms]
    if args.rounds < 3:
        p.error("--rounds: at least 3 (the A/A interval needs 2 pairs)")
    if len(set(arms)) != len(arms):
        p.error("--arm: each arm once")

    blocks: dict[str, list[float]] = {a: [] for a in arms}
    steps: dict[str, list[float]] = {a: [] for a in arms}
    t0 = time.monotonic()
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            tps, typical = run_arm(arm, args.steps, args.warmup)
            blocks[arm].append(tps)
            steps[arm].append(typical)
            print(f"round {r + 1}/{args.rounds} {arm:40s} {tps:9.0f} tokens/s "
                  f"(median step {typical:.0f})", flush=True)

    for title, figures in (("block: tokens/s over the measured steps", blocks),
                           ("median step: tokens/s of each block's median step", steps)):
        print_table(title, arms, figures)
    print(f"\n{args.rounds} rounds x {len(arms)} arms x {args.steps} steps in "
          f"{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
