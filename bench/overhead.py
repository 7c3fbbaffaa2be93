"""What observability costs the training step: bare versus full telemetry, side by side.

    python bench/overhead.py --blocks 8 --steps 40

Arms, run in blocks of ``--steps`` optimizer steps in ABBA order (the order flips every pair,
so drift in the machine's speed falls on both arms alike):

- **bare**: events go nowhere (NullSink), no per-layer norms.
- **full**: every step reported (``telemetry.every = 1``) over the real Unix-socket sink to a
  consumer in another process that decodes each event, updates the daemon's Prometheus
  families, and renders a scrape every second (as Prometheus would); per-layer norms on
  (every ``telemetry.layer_every`` steps).

Each block is one ``train()`` call on the same model config, seed and data; a block's figure
is its median step time after ``--warmup`` steps. Printed: the full/bare ratio of block
medians with a bootstrap 95% interval over blocks, and an A/A interval (bare blocks split in
two interleaved halves) beside it: the noise floor of this machine at this moment.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from traind.metrics.training import TrainingMetrics
from traind.trainer.config import TrainConfig
from traind.trainer.events import StepEvent, decode
from traind.trainer.loop import train
from traind.trainer.sink import EventSink, NullSink, SocketSink


class _TimingSink:
    """Keeps only step times; wraps the sink under test."""

    def __init__(self, inner: EventSink) -> None:
        self.inner, self.times = inner, []  # type: list[float]

    @property
    def dropped(self) -> int:
        return self.inner.dropped

    def emit(self, event) -> None:
        if isinstance(event, StepEvent):
            self.times.append(event.step_seconds)
        self.inner.emit(event)

    def close(self) -> None:
        self.inner.close()


def consumer(path: str, ready: mp.Event, stop: mp.Event) -> None:  # type: ignore[valid-type]
    """The daemon's side, in its own process: decode, update families, scrape every second."""
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

    threading.Thread(target=scrape, daemon=True).start()
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                metrics.observe(1, decode(line))


def config(steps: int, full: bool) -> TrainConfig:
    return TrainConfig.model_validate({
        "job": {"steps": steps, "eval_every": 10**9, "checkpoint_every": 10**9, "seed": 0,
                "threads": 1},
        "data": {"max_bytes": 2_000_000},
        "telemetry": {"every": 1, "per_layer": full},
    })


def run_block(full: bool, steps: int, sock: str) -> list[float]:
    sink = _TimingSink(SocketSink(sock) if full else NullSink())
    try:
        train(config(steps, full), sink)
    finally:
        sink.close()
    return sink.times


def ratio_ci(a: list[float], b: list[float], *, n: int = 4000, seed: int = 0
             ) -> tuple[float, float, float]:
    """median(b)/median(a) with a 95% bootstrap interval, resampling blocks."""
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
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="traind-bench-")
    sock = str(Path(tmp) / "events.sock")
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=consumer, args=(sock, ready, stop), daemon=True)
    proc.start()
    ready.wait(30)
    run_block(False, args.warmup + 2, sock)  # imports, allocator, corpus cache

    medians: dict[bool, list[float]] = {False: [], True: []}
    order = []
    for i in range(args.blocks):
        order += [False, True] if i % 2 == 0 else [True, False]  # A B B A A B ...
    t0 = time.monotonic()
    for k, full in enumerate(order):
        times = run_block(full, args.steps, sock)[args.warmup:]
        medians[full].append(statistics.median(times))
        print(f"block {k + 1:2d}/{len(order)} {'full' if full else 'bare':4s} "
              f"median step {medians[full][-1] * 1e3:7.2f} ms", flush=True)
    stop.set()
    proc.join(5)

    bare, full = medians[False], medians[True]
    r, lo, hi = ratio_ci(bare, full)
    aa, aa_lo, aa_hi = ratio_ci(bare[0::2], bare[1::2])
    print()
    print(f"{'comparison':28s} {'ratio':>7s} {'95% CI':>17s}")
    print(f"{'full / bare telemetry':28s} {r:7.4f} [{lo:.4f}, {hi:.4f}]")
    print(f"{'A/A: bare / bare':28s} {aa:7.4f} [{aa_lo:.4f}, {aa_hi:.4f}]")
    print(f"\n{len(order)} blocks x {args.steps} steps in {time.monotonic() - t0:.0f} s; "
          f"median step bare {statistics.median(bare) * 1e3:.2f} ms, "
          f"full {statistics.median(full) * 1e3:.2f} ms. Budget: upper bound < 1.02.")


if __name__ == "__main__":
    main()
