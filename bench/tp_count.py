"""The cost of counting tensor parallel's collectives (trainer/tp_comm.py) on a step.

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/tp_count.py
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/tp_count.py --d-model 256

Two gloo ranks hold the tp2 GPT (trainer/tensor_parallel.py's plan); each round runs one
forward and backward with the counting dispatch mode and one without, in an order that
alternates, after a barrier. Printed: the median of each and their ratio, what a counted step
costs beside a plain one (the loop counts once in ``telemetry.layer_every`` steps because of
it). One thread per rank: the ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from traind.trainer.collectives import HostClock
from traind.trainer.config import ModelConfig
from traind.trainer.mesh import MeshShape, build_mesh
from traind.trainer.model import GPT
from traind.trainer.tensor_parallel import apply_tensor_parallel
from traind.trainer.tp_comm import MeshCollectives


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = ModelConfig(d_model=args.d_model, n_layers=2, n_heads=4, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = build_mesh(MeshShape(dp=1, tp=dist.get_world_size()), "cpu")
    apply_tensor_parallel(model, mesh["tp"])
    counter = MeshCollectives.for_mesh(mesh, HostClock())
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))  # (B, T)
    y = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))

    def step(counted: bool) -> float:
        t0 = time.perf_counter()
        with counter.recording() if counted else contextlib.nullcontext():
            _, loss = model(x, y)
            loss.backward()
        return time.perf_counter() - t0

    for _ in range(5):  # warm-up, both ways
        step(False)
        step(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for counted in (False, True) if r % 2 else (True, False):
            dist.barrier()
            times[counted].append(step(counted))
    counter.take()
    if dist.get_rank() == 0:
        plain, counted = statistics.median(times[False]), statistics.median(times[True])
        print(f"d_model {args.d_model}: plain {plain * 1e3:.2f} ms, counted "
              f"{counted * 1e3:.2f} ms, ratio {counted / plain:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
