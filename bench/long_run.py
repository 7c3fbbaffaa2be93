"""A long finished run in a daemon's database, written as the daemon writes one: a 2-rank run's
step, per-rank, layer and communication events through the ingest's own SeriesRecorder, sealed
every ``steps_per_flush`` steps (the flush's second), into the real schema. For the series
read case of ``bench/load.py --hostile`` (issue 40.5: a 14.6k-step run was 1,259 event rows,
11.7 MB; the goal is at 10x that).

    python bench/long_run.py VAR_DIR --steps 146000
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from traind.contracts.comm import LATENCY_BOUNDS
from traind.contracts.events import CommEvent, LayerEvent, StepEvent
from traind.daemon.db import crud
from traind.daemon.db.engine import default_url, make_engine
from traind.daemon.db.migrate import upgrade
from traind.daemon.ingest.series import SeriesRecorder

LAYERS = [f"blocks.{i}.{p}" for i in range(8)
          for p in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")]
OPS = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")
SIZES = ("<64KiB", "64KiB-1MiB", "1-16MiB")


def _comm(rank: int, step: int, every: int) -> CommEvent:
    return CommEvent(
        rank=rank, step=step, method="none", steps=every, buckets=every * 2,
        raw_bytes=every * 4_000_000, sent_bytes=every * 4_000_000, rel_error=0.0,
        hook_seconds=0.001, allreduce_seconds=0.02, world_size=2, time=1e9 + step,
        collectives=[{"op": op, "size": size, "calls": every, "bytes": every * 2_000_000,
                      "seconds": 0.01 * every,
                       "counts": [every if i == 3 else 0 for i in range(len(LATENCY_BOUNDS) + 1)]}
                     for op in OPS for size in SIZES])


def seed(var_dir: Path, *, steps: int, ranks: int = 2, steps_per_flush: int = 46,
         report_every: int = 10) -> int:
    """Write the run; returns its id."""
    var_dir.mkdir(parents=True, exist_ok=True)
    url = default_url(var_dir)
    upgrade(url)
    engine = make_engine(url)
    run_id = crud.create_run(engine, name="long", config={}, kind="job", node="")
    recorder = SeriesRecorder(lambda _run: 50_000.0, lambda _run: ranks)
    rng = random.Random(0)

    class Rows:
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def add(self, _run: int, row: dict) -> None:
            self.rows.append(row)

    rows = Rows()
    for step in range(1, steps + 1):
        loss = 8 * math.exp(-step / 20_000) + 2 + rng.gauss(0, 0.05)
        for rank in range(ranks):
            e = StepEvent(rank=rank, step=step, loss=loss + rng.gauss(0, 0.01), lr=3e-4,
                          grad_norm=1 + rng.random(), tokens=4096,
                          step_seconds=0.08 + rng.random() * 0.01, data_seconds=0.001,
                          forward_seconds=0.03, backward_seconds=0.04,
                          optimizer_seconds=0.01, time=1e9 + step * 0.08)
            if rank == 0:
                recorder(run_id, e)
            recorder.every_rank(run_id, e)
            if step % report_every == 0:
                recorder.every_rank(run_id, _comm(rank, step, report_every))
        if step % report_every == 0:
            recorder(run_id, LayerEvent(rank=0, step=step, layers=LAYERS,
                                        grad_norm=[rng.random() for _ in LAYERS],
                                        update_ratio=[rng.random() * 1e-3 for _ in LAYERS],
                                        weight_norm=[1.0 for _ in LAYERS]))
        if step % steps_per_flush == 0 or step == steps:
            recorder.seal(rows)
        if len(rows.rows) >= 400:
            crud.add_events(engine, run_id=run_id, events=rows.rows)
            rows.rows = []
    crud.add_events(engine, run_id=run_id, events=rows.rows)
    crud.mark_finished(engine, run_id=run_id, state="completed", exit_code=0, error=None)
    return run_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("var_dir", type=Path)
    ap.add_argument("--steps", type=int, default=146_000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    run_id = seed(args.var_dir, steps=args.steps)
    db = args.var_dir / "traind.db"
    print(f"run {run_id}: {args.steps} steps in {time.perf_counter() - t0:.0f} s"
          + (f", {db.stat().st_size / 2**20:.0f} MiB database" if db.exists() else ""))


if __name__ == "__main__":
    main()
