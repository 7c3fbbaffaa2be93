"""The model as one rank trains it: built, converted, sharded, compiled, split and wrapped.

:func:`build_stack` runs once per call of ``train`` (trainer/loop.py, which only runs what it
returns). The order is torchtitan's, and each step needs the one before it:

1. the model, seeded alike on every rank (DDP broadcasts rank 0's weights anyway);
2. precision: fp8 swaps the Linear layers and adaptive hooks the blocks, before any wrap;
3. the mesh from the ranks torchrun really gave, in the placement's order; tensor parallel
   shards the full weights just initialised, so a tp run starts from the one-rank model;
4. compile (the graphs capture fp8's Linear layers; FSDP's hooks stay outside the compiled
   forwards);
5. the pipeline split: this rank's stages of the seeded model, the rest dropped;
6. the dp wrap, then the optimizer (FSDP replaces the parameters with sharded DTensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from traind.contracts.events import LifecycleEvent
from traind.trainer.attention import choose_ahead
from traind.trainer.collectives import clock_for
from traind.trainer.compile import compile_blocks, should_compile
from traind.trainer.factory import build_model
from traind.trainer.linkprobe import place
from traind.trainer.mesh import (
    MeshShape,
    build_mesh,
    hsdp_shard,
    job_microbatches,
    needs_mesh,
    pp_coordinate,
    resolve,
)
from traind.trainer.model import GPT
from traind.trainer.parallel import Strategy, build_strategy
from traind.trainer.pipeline_parallel import Pipeline, split_model
from traind.trainer.precision import PrecisionPolicy, build_policy

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from traind.contracts.events import Event
    from traind.trainer.config import TrainConfig
    from traind.trainer.distributed import DistInfo
    from traind.trainer.tp_comm import MeshCollectives


@dataclass(frozen=True, slots=True)
class Stack:
    """What :func:`build_stack` made, on this rank."""

    model: nn.Module  # this rank's part (a pipeline stage's), unwrapped: its parameters
    module: nn.Module  # ``model`` wrapped by the dp strategy: what a step calls
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    precision: PrecisionPolicy  # the job's policy (an A/B job's arms may switch to others)
    shape: MeshShape
    order: list[int]  # the ranks in (pp, dp, tp) slot order (parallel.placement)
    slot: int  # this rank's place in that order: what its mesh coordinates are of
    pipeline: Pipeline | None  # this rank's stages and their schedule (pp > 1)
    tp_comm: MeshCollectives | None  # tensor parallel's collectives counter (tp > 1, eager)
    compile_note: str  # "on (why)" or "off (why)": the started event's
    params: int  # the whole model's, before a pipeline stage kept its part
    flops_per_token: float  # the whole model's


def build_stack(cfg: TrainConfig, info: DistInfo, emit: Callable[[Event], None]) -> Stack:
    """This rank's model stack for ``cfg`` (the steps in the module's doc, in order).

    ``emit`` takes the events made on the way: the link probe's (``parallel.placement``) and
    a compile fallback's."""
    device, p = info.device, cfg.parallel
    torch.manual_seed(cfg.job.seed)  # same weights on every rank
    gpt = build_model(cfg.model).to(device)
    params, flops_per_token = gpt.num_params(), gpt.flops_per_token()
    model: nn.Module = gpt
    precision = build_policy(cfg.precision, device)
    precision.prepare(model)  # in place: the same module comes back
    shape = resolve(cfg, info.world_size)
    order = place(p, shape, info, emit)
    slot = order.index(info.rank)
    mesh = (build_mesh(shape, device.type, order)
            if needs_mesh(shape, p.strategy) else None)
    if mesh is not None and shape.tp > 1:
        # imported for tp only: DTensor's package adds 0.4 s to a job's start-up
        from traind.trainer.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    compiled, compile_note = _compile(
        cfg, shape, model, precision, flops_per_token, device,
        fell_back=lambda reason: emit(LifecycleEvent(
            rank=info.rank, phase="compile_fallback", step=0, detail={"reason": reason})))
    chunks: list[nn.Module] = []  # a pipeline rank's stages (looped: several)
    if shape.pp > 1:
        # a factory's model has no stage plan: trainer/mesh.py refuses pp with one
        assert isinstance(gpt, GPT), "pipeline parallel needs traind's own model"
        model, stages = split_model(
            gpt, stage=pp_coordinate(shape, slot), stages=shape.pp,
            virtual=p.pp_virtual_stages if p.pp_schedule == "interleaved_1f1b" else 1,
            tp=shape.tp)
        chunks = list(stages)
    del gpt
    # Then a per-rank seed, so that dropout masks differ between ranks.
    torch.manual_seed(cfg.job.seed + 1_000_003 * info.rank)
    strategy = build_strategy(
        p, info, cfg.precision.mode, mesh,
        dp_shard=hsdp_shard(shape.dp, tp=shape.tp, dp_shard=p.dp_shard,
                            nproc_per_node=cfg.job.nproc_per_node))
    module = strategy.wrap(model)
    pipeline = None
    if mesh is not None and shape.pp > 1:
        pipeline = Pipeline(  # one stage: its (dp-wrapped) module; looped stages their own
            [module] if len(chunks) == 1 else chunks, stage=pp_coordinate(shape, slot),
            stages=shape.pp, schedule=p.pp_schedule, microbatches=job_microbatches(cfg),
            accum=p.grad_accum, group=mesh["pp"].get_group(), device=device,
            scale=precision.scale)
        # the stages hold different parameters: one overflow verdict, one SNR per group
        precision.agree_on_overflow(pipeline.group)
        precision.split_over_stages(model, pipeline.group)
    return Stack(model=model, module=module, strategy=strategy,
                 optimizer=strategy.optimizer(model, cfg.optim), precision=precision,
                 shape=shape, order=order, slot=slot, pipeline=pipeline,
                 tp_comm=_tp_comm(mesh, shape, compiled=compiled, device_type=device.type),
                 compile_note=compile_note, params=params, flops_per_token=flops_per_token)


def _compile(cfg: TrainConfig, shape: MeshShape, model: nn.Module, precision: PrecisionPolicy,
             flops_per_token: float, device: torch.device,
             fell_back: Callable[[str], None]) -> tuple[bool, str]:
    """Compile the blocks if ``job.compile`` says so: whether it did, and the started
    event's note on it."""
    step_flops = (flops_per_token * cfg.job.batch_size * cfg.model.seq_len
                  * cfg.parallel.grad_accum)
    on, why = should_compile(cfg.job.compile, device.type, steps=cfg.job.steps,
                             step_flops=step_flops)
    if not on:
        return False, f"off ({why})"
    # The attention backend is timed eagerly now: inside the trace nothing is timed, and
    # the compiled blocks would keep the static rule's pick. Training and evaluation.
    m = cfg.model
    heads = (cfg.job.batch_size, m.n_heads // shape.tp, m.seq_len,
             m.d_model // m.n_heads)  # this rank's heads
    for grad in (True, False):
        choose_ahead(m, heads, device, precision.compute_dtype, grad=grad)
    compile_blocks(model, on_fallback=fell_back)  # the blocks keep what it made
    return True, f"on ({why})"


def _tp_comm(mesh: DeviceMesh | None, shape: MeshShape, *, compiled: bool,
             device_type: str) -> MeshCollectives | None:
    """The counter of tensor parallel's collectives (None without tp). Not under
    ``job.compile``: a dispatch mode around compiled blocks would guard and recompile
    them on every counted step."""
    if mesh is None or shape.tp == 1 or compiled:
        return None
    from traind.trainer.tp_comm import MeshCollectives

    return MeshCollectives.for_mesh(mesh, clock_for(device_type))
