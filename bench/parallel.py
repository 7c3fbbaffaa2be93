"""Tensor and pipeline parallel against data parallel on the same 2 CPU ranks: memory per
rank, step time, the collectives tensor parallel issues (counted at the dispatcher) and the
pipeline's bubble, measured beside the schedule's theory.

    python bench/parallel.py                      # d_model 256, 4 layers; ~1 minute on 2 cores
    python bench/parallel.py --d-model 512 --steps 6

Layouts, each on 2 gloo ranks (forked, one thread each), same model and batch per step:
- ``dp2 (ddp)``: whole weights on each rank, each rank half the batch.
- ``dp2 (fsdp)``: FSDP2 per block, weights and optimizer state sharded.
- ``tp2``: trainer/tensor_parallel.py's plan, both ranks the whole batch.
- ``pp2 (gpipe)``, ``pp2 (1f1b)``: trainer/pipeline_parallel.py's stages (half the blocks
  each), the whole batch in ``--microbatches`` micro-batches.

Columns: ``params/rank`` (bytes of the parameters a rank holds between steps; AdamW's state
and the gradients scale with it, 4x in all for fp32), its ratio to ddp's; ``peak RSS``: the
process's peak resident memory (ru_maxrss; the torch runtime is most of it at this size);
``step ms`` median; ``bubble``: a pipeline stage's idle share of its step (host time, median
over steps, stage 0) and the schedule's (p-1)/(m+p-1). Then the per-op collective counts
of one tp2 step. On one machine the ranks share 2 cores: step times are loopback figures,
only their ratios mean anything.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from traind.trainer.config import TrainConfig
from traind.trainer.distributed import DistInfo
from traind.trainer.mesh import MeshShape, build_mesh
from traind.trainer.model import GPT
from traind.trainer.optim import clip_grad_norm
from traind.trainer.parallel import build_strategy
from traind.trainer.pipeline_parallel import Pipeline, split_model, theoretical_bubble
from traind.trainer.tensor_parallel import apply_tensor_parallel

LAYOUTS = ("dp2 (ddp)", "dp2 (fsdp)", "tp2", "pp2 (gpipe)", "pp2 (1f1b)")


# helpers in the functional-collectives namespace that move no data
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


class _CountCollectives(TorchDispatchMode):
    """The functional collectives DTensor issues, by op. DTensor's own CommDebugMode counts
    the same, but its module tracker raised IndexError inside this model's forward hooks
    (torch 2.13): a plain dispatch mode sees every op without it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name not in _NOT_COLLECTIVES:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _rank(rank: int, store: str, layout: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        tp, pp = layout == "tp2", layout.startswith("pp2")
        strategy_name = "fsdp" if "fsdp" in layout else "ddp"
        schedule = layout[5:-1] if pp else "1f1b"
        cfg = TrainConfig.model_validate({
            "job": {"nproc_per_node": 2, "batch_size": args.batch},
            "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 8,
                      "seq_len": 128},
            "parallel": {"strategy": strategy_name, "tp": 2 if tp else 1, "pp": 2 if pp else 1,
                         "pp_schedule": schedule, "microbatches": args.microbatches}})
        torch.manual_seed(0)
        model: torch.nn.Module = GPT(cfg.model)
        info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"),
                        owns_group=False)
        mesh = (build_mesh(MeshShape(dp=1, tp=2 if tp else 1, pp=2 if pp else 1), "cpu")
                if tp or pp else None)
        if mesh is not None and tp:
            apply_tensor_parallel(model, mesh["tp"])
        if pp:
            model = split_model(model, stage=rank, stages=2)[0]  # type: ignore[arg-type]
        strategy = build_strategy(cfg.parallel, info, "fp32", mesh)
        module = strategy.wrap(model)
        opt = strategy.optimizer(model, cfg.optim)
        pipe = (Pipeline([module], stage=rank, stages=2, schedule=schedule,
                         microbatches=args.microbatches, accum=1,
                         group=mesh["pp"].get_group(), device=torch.device("cpu"))
                if pp and mesh is not None else None)
        bubbles = []
        # the same tokens per step in all: tp and pp ranks share one batch
        batch = args.batch if tp or pp else args.batch // 2
        gen = torch.Generator().manual_seed(rank if not tp else 0)
        times = []
        counts: dict[str, int] = {}
        for step in range(args.steps):
            x = torch.randint(0, 256, (batch, 129), generator=gen)
            t0 = time.perf_counter()
            if pipe is not None:
                pipe.step(x[:, :-1], x[:, 1:])
                t = pipe.last_timing
                bubbles.append(t.idle / t.wall)
            elif tp and step == args.steps - 1:
                comm = _CountCollectives()
                with comm:
                    _, loss = module(x[:, :-1], x[:, 1:])
                    loss.backward()  # type: ignore[union-attr]
                counts = comm.counts
            else:
                _, loss = module(x[:, :-1], x[:, 1:])
                loss.backward()  # type: ignore[union-attr]
            clip_grad_norm(model.parameters(), 1.0, pipe.group if pipe else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        local = sum(getattr(p, "_local_tensor", p).numel() * p.element_size()
                    for p in model.parameters())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        bubble = statistics.median(bubbles[1:]) if bubbles else None
        out[(layout, rank)] = (local, peak, statistics.median(times[1:]), counts, bubble)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (the job's)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4, help="pp2's micro-batches")
    args = ap.parse_args()
    out = mp.Manager().dict()
    for layout in LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_rank, args=(f"{tmp}/store", layout, args, out), nprocs=2,
                               start_method="fork")
    base = out[(LAYOUTS[0], 0)][0]
    theory = theoretical_bubble(2, args.microbatches)
    print(f"{'layout':<13}{'params/rank':>14}{'vs ddp':>8}{'peak RSS':>12}{'step ms':>10}"
          f"{'bubble':>9}{'theory':>8}")
    for layout in LAYOUTS:
        local, peak, step, _, bubble = out[(layout, 0)]
        pipe = f"{bubble:>9.2f}{theory:>8.2f}" if bubble is not None else ""
        print(f"{layout:<13}{local / 2**20:>11.2f} MiB{local / base:>8.2f}"
              f"{peak / 2**20:>8.0f} MiB{step * 1e3:>10.1f}{pipe}")
    print("tp2 collectives in one step (forward + backward), per op:", out[("tp2", 0)][3])


if __name__ == "__main__":
    main()
