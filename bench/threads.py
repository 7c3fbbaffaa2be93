"""Intra-op threads per rank under outside load: the default (``job.threads=0``) against
fixed counts, with busy-loop processes competing for the CPUs (issue 14).

    python bench/threads.py --ranks 2 --load 2 --arm 2 --arm 0 --rounds 2 --steps 40

Each ``--arm`` is a ``job.threads`` value (0 = the default, trainer/threads.py). The job is
``traind run``'s path (bench/speed.py's ``run_job``: torchrun, the worker, events over the
socket) with the default model and batch; ``--load`` processes spin ``while True: pass`` for
the whole bench. Rounds run the arms in an order reversed every other round, so drift falls
on all alike. Printed per arm: the threads each rank took (its started event), the usable CPUs
and the job's tokens/s (rank 0's after ``--warmup`` steps, times the ranks) per round. The old
rule's count (torch's threads over the world size) is printed beside: under torchrun that is
``OMP_NUM_THREADS`` (1 whenever nproc_per_node > 1, torchrun sets it) over the ranks.

Measured here (2 CPUs, no quota; the command above, 5 minutes): 2 threads per rank 750 tok/s
(729, 770), the default (1 per rank) 7,995 (7,717, 8,273): 10.7x. The old rule also took 1
thread per rank for 2 ranks under torchrun; it took 2 for a 1-rank job, which the new rule
also does (2 usable CPUs, 1 local rank): runs beside each other on one node still share the
CPUs, which no per-job rule can see (the node's queue has to).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from speed import run_job  # bench/ is on sys.path when this runs as a script

from traind.contracts.events import LifecycleEvent, StepEvent
from traind.trainer.config import TrainConfig
from traind.trainer.threads import usable_cpus

if TYPE_CHECKING:
    from traind.contracts.events import Event


def config(ranks: int, threads: int, steps: int) -> TrainConfig:
    return TrainConfig.model_validate({"job": {
        "steps": steps, "nproc_per_node": ranks, "threads": threads, "eval_every": 10**9,
        "checkpoint_every": 10**9, "resume": False, "compile": False}})


def job_tokens_per_second(events: list[Event], warmup: int, ranks: int) -> float:
    timed = [e for e in events if isinstance(e, StepEvent) and e.rank == 0 and e.step >= warmup]
    tokens = sum(e.tokens * e.steps for e in timed[1:])
    return ranks * tokens / (timed[-1].time - timed[0].time)


def old_rule(ranks: int) -> int:
    """What ``torch.get_num_threads() // world_size`` gave inside a rank launched here."""
    env = "OMP_NUM_THREADS=1 " if ranks > 1 else ""
    out = subprocess.run(["sh", "-c", f"{env}{sys.executable} -c 'import torch; "
                          "print(torch.get_num_threads())'"], capture_output=True, text=True,
                         check=True)
    return max(1, int(out.stdout) // ranks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--load", type=int, default=2, help="busy-loop processes")
    p.add_argument("--arm", type=int, action="append", help="job.threads (0 = default)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    arms = args.arm or [2, 0]
    print(f"usable CPUs {usable_cpus()}, {args.ranks} ranks, {args.load} busy loops; the old "
          f"rule gives {old_rule(args.ranks)} thread(s) per rank here")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    figures: dict[int, list[float]] = {a: [] for a in arms}
    took: dict[int, object] = {}
    try:
        time.sleep(1)
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                events = run_job(config(args.ranks, arm, args.steps))
                started = next(e for e in events if isinstance(e, LifecycleEvent)
                               and e.phase == "started" and e.rank == 0)
                took[arm] = started.detail.get("threads")
                figures[arm].append(job_tokens_per_second(events, args.warmup, args.ranks))
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print(f"{'job.threads':>11s} {'took':>5s} {'median tok/s':>13s}  per round")
    for arm in arms:
        rounds = " ".join(f"{x:,.0f}" for x in figures[arm])
        print(f"{arm:>11d} {took[arm]!s:>5s} {statistics.median(figures[arm]):13,.0f}  {rounds}")


if __name__ == "__main__":
    main()
