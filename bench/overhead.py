"""What observability costs the training step: bare versus full telemetry, side by side.

    python bench/overhead.py --blocks 8 --steps 40
    python bench/overhead.py --blocks 8 --steps 40 --ranks 2     # everything, on 2 ranks
    python bench/overhead.py --blocks 8 --steps 40 --ranks 2 --only-collectives

Arms, run in blocks of ``--steps`` optimizer steps in ABBA order (the order flips every pair,
so drift in the machine's speed falls on both arms alike):

- **bare**: events go nowhere (NullSink), no per-layer norms.
- **full**: every step reported (``telemetry.every = 1``) over the real Unix-socket sink to a
  consumer in another process that decodes each event, updates the daemon's Prometheus
  families, and renders a scrape every second (as Prometheus would); per-layer norms on
  (every ``telemetry.layer_every`` steps).

With ``--ranks N`` (N > 1) each block is a torchrun job of N gloo ranks under DDP, both arms
sending to the consumer; the full arm adds every step's report, per-layer norms and the DDP
hook's per-collective figures (``telemetry.collectives``: calls, bytes and latency by op and
message size, the NCCL Inspector's; NVIDIA publishes no overhead figure for its Inspector);
the bare arm reports once at the end and times no collective. A block's figure is rank 0's
loop time per step (its finished event), start-up left out.

Each block is one ``train()`` call on the same model config, seed and data. A block's figure
is its wall time per step after ``--warmup`` steps: the time from one report to the last,
divided by the steps between (the inverse of its throughput), so a cost paid every tenth step
(per-layer norms) counts, where a median would hide it.

The analysis is the A/B scheduler's own (``traind.daemon.experiments.stats.speedup``, paired).
Each pair of adjacent blocks (one of each arm) gives a log ratio, so the machine's slow drift (often
several percent over a run here) cancels within the pair instead of widening the interval.
Printed: the full/bare ratio with its 95% interval; an A/A interval beside it from adjacent
blocks of the same arm (B B and A A at the seams of the ABBA order), the noise floor of this
machine at this moment; the same ratio from the trainer's own step timing (which leaves out
the emitting after each step); and the unpaired ratio of block figures with a bootstrap
interval.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from traind.contracts.events import LifecycleEvent, StepEvent, decode
from traind.daemon.experiments.stats import speedup
from traind.metrics.training import TrainingMetrics
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import EventSink, NullSink, SocketSink


class _TimingSink:
    """Keeps each step's timings; wraps the sink under test. ``walls``: the time between one
    step's report and the next, i.e. everything the loop does per step, telemetry included
    (emitting, per-layer norms, a consumer competing for the CPU); ``times``: the step's own
    phases as the trainer times them (data, forward, backward, optimizer), which leave out
    the emitting that follows them."""

    def __init__(self, inner: EventSink) -> None:
        self.inner = inner
        self.times: list[float] = []
        self.walls: list[float] = []
        self._last: float | None = None

    @property
    def dropped(self) -> int:
        return self.inner.dropped

    def emit(self, event) -> None:
        if isinstance(event, StepEvent):
            now = time.perf_counter()
            self.times.append(event.step_seconds)
            if self._last is not None:
                self.walls.append(now - self._last)
            self._last = now
        self.inner.emit(event)

    def close(self) -> None:
        self.inner.close()


def consumer(path: str, ready: mp.Event, stop: mp.Event,  # type: ignore[valid-type]
             finished: mp.Queue | None = None) -> None:  # type: ignore[valid-type]
    """The daemon's side, in its own process: decode, update families, scrape every second.
    Every connection (a rank's sink) is read on a thread of its own, as the daemon reads a
    job's ranks. ``finished``: rank 0's loop seconds, from its finished event, are put there
    (the figure of a ``--ranks`` block)."""
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    server.settimeout(0.2)
    ready.set()

    def scrape() -> None:
        while not stop.wait(1.0):
            generate_latest(registry)

    lock = threading.Lock()  # the families are the daemon's: one event loop updates them

    def read(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                event = decode(line)
                with lock:
                    metrics.observe(1, event)
                if (finished is not None and isinstance(event, LifecycleEvent)
                        and event.phase == "finished" and event.rank == 0):
                    finished.put(float(event.detail["seconds"]))

    threading.Thread(target=scrape, daemon=True).start()
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        threading.Thread(target=read, args=(conn,), daemon=True).start()


def config(steps: int, full: bool) -> TrainConfig:
    return TrainConfig.model_validate({
        "job": {"steps": steps, "eval_every": 10**9, "checkpoint_every": 10**9, "seed": 0,
                "threads": 1},
        "data": {"max_bytes": 2_000_000},
        "telemetry": {"every": 1, "per_layer": full},
    })


def run_block(full: bool, steps: int, sock: str) -> _TimingSink:
    sink = _TimingSink(SocketSink(sock) if full else NullSink())
    try:
        train(config(steps, full), sink)
    finally:
        sink.close()
    return sink


def ranked_config(steps: int, full: bool, ranks: int, only_collectives: bool = False
                  ) -> dict[str, Any]:
    """A ``--ranks`` block's job: DDP over gloo. Full: every step reported, per-layer norms,
    and the hook's per-collective figures (``telemetry.collectives``: the NCCL Inspector's);
    bare: one report at the end, no norms, no collective timed. ``only_collectives``: the
    full arm differs from the bare one in the per-collective figures alone."""
    every = 1 if full and not only_collectives else 10**6
    return {
        "job": {"steps": steps, "eval_every": 10**9, "checkpoint_every": 10**9, "seed": 0,
                "threads": 1, "nproc_per_node": ranks},
        "data": {"max_bytes": 2_000_000},
        "telemetry": {"every": every, "per_layer": full and not only_collectives,
                      "collectives": full},
    }


def run_ranked_block(full: bool, steps: int, ranks: int, sock: str, folder: Path,
                     finished: Any, only_collectives: bool = False) -> float:
    """One torchrun job of ``ranks`` ranks sending to the consumer; its loop seconds per
    step (rank 0's finished event: the loop's wall time, start-up left out)."""
    cfg = folder / "config.json"
    cfg.write_text(json.dumps(ranked_config(steps, full, ranks, only_collectives)))
    with open(folder / "log", "ab") as log:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={ranks}", "--max_restarts=0", "-m",
                        "traind.trainer.worker", "--config", str(cfg), "--events", sock],
                       stdout=log, stderr=subprocess.STDOUT, check=True, timeout=600)
    return float(finished.get(timeout=60)) / steps


def paired(blocks: list[tuple[bool, float]]) -> tuple[list[float], list[float],
                                                      list[float], list[float]]:
    """From the blocks in run order, ``(full?, median step)``: the A/B pairs (positions 2i and
    2i+1, one of each arm) as (bare, full) lists, and the A/A pairs (adjacent blocks of one
    arm, the seams between A/B pairs) as (earlier, later) lists."""
    bare, full, first, second = [], [], [], []
    for i in range(0, len(blocks) - 1, 2):
        (arm_x, x), (arm_y, y) = blocks[i], blocks[i + 1]
        assert arm_x != arm_y, "ABBA order: each pair has one block of each arm"
        bare.append(y if arm_y is False else x)
        full.append(x if arm_y is False else y)
    for i in range(1, len(blocks) - 1, 2):
        (arm_x, x), (arm_y, y) = blocks[i], blocks[i + 1]
        if arm_x == arm_y:
            first.append(x)
            second.append(y)
    return bare, full, first, second


def ratio_ci(a: list[float], b: list[float], *, n: int = 4000, seed: int = 0
             ) -> tuple[float, float, float]:
    """median(b)/median(a) with a 95% bootstrap interval, resampling blocks (unpaired)."""
    rng = random.Random(seed)
    point = statistics.median(b) / statistics.median(a)
    boots = sorted(statistics.median(rng.choices(b, k=len(b)))
                   / statistics.median(rng.choices(a, k=len(a))) for _ in range(n))
    return point, boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8, help="blocks per arm (even)")
    p.add_argument("--steps", type=int, default=40, help="steps per block")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each block")
    p.add_argument("--ranks", type=int, default=1, help="ranks per block: more than one runs "
                   "each block as a torchrun DDP job (the per-collective figures' cost)")
    p.add_argument("--only-collectives", action="store_true", help="with --ranks: the arms "
                   "differ in telemetry.collectives alone (both report once, no norms)")
    args = p.parse_args()
    if args.blocks < 4 or args.blocks % 2:
        p.error("--blocks: an even number, at least 4 (the A/A interval needs 2 seams)")
    if args.steps <= args.warmup + 1:
        p.error("--steps: more than --warmup + 1")
    if args.ranks < 1:
        p.error("--ranks: 1 or more")

    tmp = tempfile.mkdtemp(prefix="traind-bench-")
    sock = str(Path(tmp) / "events.sock")
    ctx = mp.get_context("spawn")
    ready, stop, finished = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(sock, ready, stop, finished), daemon=True)
    proc.start()
    ready.wait(30)
    ranked = args.ranks > 1
    if not ranked:
        run_block(False, args.warmup + 2, sock)  # imports, allocator, corpus cache
    else:
        run_ranked_block(False, args.warmup + 2, args.ranks, sock, Path(tmp), finished)

    medians: dict[bool, list[float]] = {False: [], True: []}
    blocks: list[tuple[bool, float]] = []  # wall time per step, in run order
    inside: list[tuple[bool, float]] = []  # the trainer's own step time, in run order
    order = []
    for i in range(args.blocks):
        order += [False, True] if i % 2 == 0 else [True, False]  # A B B A A B ...
    t0 = time.monotonic()
    for k, full in enumerate(order):
        if ranked:
            medians[full].append(run_ranked_block(full, args.steps, args.ranks, sock,
                                                  Path(tmp), finished, args.only_collectives))
            note = f"{args.ranks} ranks, loop time per step"
        else:
            timed = run_block(full, args.steps, sock)
            medians[full].append(statistics.fmean(timed.walls[args.warmup:]))
            inside.append((full, statistics.median(timed.times[args.warmup:])))
            note = f"trainer's own median {inside[-1][1] * 1e3:7.2f} ms"
        blocks.append((full, medians[full][-1]))
        print(f"block {k + 1:2d}/{len(order)} {'full' if full else 'bare':4s} "
              f"wall per step {medians[full][-1] * 1e3:7.2f} ms ({note})", flush=True)
    stop.set()
    proc.join(5)

    bare, full = medians[False], medians[True]
    pb, pf, aa_first, aa_second = paired(blocks)
    rows = [("full / bare, paired", speedup(pb, pf, paired=True)),
            ("A/A: same arm, adjacent blocks", speedup(aa_first, aa_second, paired=True))]
    if inside:
        ib, if_, _, _ = paired(inside)
        rows.append(("full / bare, trainer's own timing", speedup(ib, if_, paired=True)))
    r, lo, hi = ratio_ci(bare, full)
    print()
    print(f"{'comparison (wall time per step)':34s} {'ratio':>7s} {'95% CI':>17s} "
          f"{'pairs':>5s}")
    for name, iv in rows:
        print(f"{name:34s} {iv.ratio:7.4f} [{iv.low:.4f}, {iv.high:.4f}] {iv.n:5d}")
    print(f"{'full / bare, unpaired medians':34s} {r:7.4f} [{lo:.4f}, {hi:.4f}]")
    ab = rows[0][1]
    print(f"\n{len(order)} blocks x {args.steps} steps x {args.ranks} rank(s) in "
          f"{time.monotonic() - t0:.0f} s; wall per step (median block) bare "
          f"{statistics.median(bare) * 1e3:.2f} ms, full {statistics.median(full) * 1e3:.2f} "
          f"ms. Budget: the paired upper bound < 1.02: "
          f"{'met' if ab.high < 1.02 else 'NOT met'}.")


if __name__ == "__main__":
    main()
