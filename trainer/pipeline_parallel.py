"""Pipeline parallel over the mesh's ``pp`` dimension, with PyTorch's own engine
(``torch.distributed.pipelining``): ``PipelineStage`` and its GPipe, 1F1B and interleaved 1F1B
schedules (the last with looped stages: rank r runs stages r, r + pp, ...; all three run on
gloo as on NCCL).

The split follows torchtitan's manual one (``distributed/pipeline_parallel.py``: one model per
stage, holding only its layers), kept by reference instead of a deep copy: every rank builds the
full seeded ``GPT`` (so a stage starts from exactly the one-rank weights), and a
:class:`StageModule` holds its share of the same modules; the rest are dropped with the full
model. Parameter names stay the full model's (``blocks.3.attn.q.weight``), so a stage's
state_dict is a slice of the one-rank model's and torch.distributed.checkpoint can put the
slices back together on another mesh.

The last stage computes the loss; the schedule averages nothing itself (``scale_grads`` off):
the loss function divides by micro-batches x ``parallel.grad_accum``, so gradients sum to the
one-rank mean's whatever the accumulation. The step's mean loss is broadcast from the last
stage to the others, so every rank reports the real loss.

What a step shows: the time this stage spent computing (its forward and backward chunks and the
loss) beside the step's wall time; the rest is the bubble, waiting on the neighbours. That is
host time: on CUDA the kernels are asynchronous and the figure would need events (later work).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from traind.trainer.model import run_blocks
from traind.trainer.pipeline_p2p import Tally, p2p_totals, timing_p2p

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.model import GPT

# torch.distributed.pipelining's class of each schedule: gpipe and 1f1b run one stage per
# rank, interleaved_1f1b a rank's looped stages. By name, imported when a pipeline is built:
# the package imports torch._dynamo, 1.3 s of start-up that a job without pp need not pay.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B"}
LOOPED = "interleaved_1f1b"


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The blocks stage ``stage`` of ``stages`` holds: consecutive, as even as they divide,
    the first stages taking one more when they do not (``n_layers >= stages``)."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def rank_stages(rank_stage: int, stages: int, virtual: int = 1) -> list[int]:
    """The stages the rank at pp coordinate ``rank_stage`` of ``stages`` runs: itself, or
    with ``virtual`` looped stages each (interleaved 1F1B) ``rank_stage + i * stages``, so the
    micro-batches loop through the ranks ``virtual`` times."""
    return [rank_stage + i * stages for i in range(virtual)]


def theoretical_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a step with equal stages and free communication:
    (p - 1) / (v m + p - 1). GPipe and 1F1B (v = 1) are the GPipe paper's (p - 1) / (m + p - 1)
    (1F1B idles as long, holding fewer activations); ``virtual`` looped stages per rank
    (interleaved 1F1B, Megatron-LM's) cut each fill and drain v-fold."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def measured_bubble(busy: float, wall: float) -> float:
    """The idle fraction of a step of ``wall`` seconds in which a stage computed ``busy``."""
    return min(1.0, max(0.0, 1.0 - busy / wall)) if wall > 0 else 0.0


class StageModule(nn.Module):
    """One stage's layers of a ``GPT``: the embedding on the first, the final norm and head
    on the last. Input: byte ids ``(B, T)`` on the first stage, activations ``(B, T, C)`` on
    the others; output: activations, or logits ``(B, T, V)`` on the last.

    Under tensor parallel (``seq_shards`` = tp) the blocks are DTensor-parallel and the
    residual stream between them, hence between stages, is each tp rank's plain local shard
    of the sequence (sequence parallel: ``(B, T / tp, C)``): a stage sends it to the same tp
    coordinate of the next stage, and no DTensor crosses a stage boundary."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, model: GPT, layers: range | list[int], *, first: bool, last: bool,
                 seq_shards: int = 1) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.seq_shards = seq_shards
        self.tok_emb = model.tok_emb if first else None
        # a dict keyed by the full model's index keeps its parameter names
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)  # (T, hs/2)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # RoPE covers the whole sequence: attention all-gathers it from the tp shards
        t = x.shape[1] * (1 if self.tok_emb is not None else self.seq_shards)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # (T, hs/2)
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # (B, T, C)
        x = run_blocks(list(self.blocks.values()), x, cos, sin, self.cfg,
                       saving=self.training and torch.is_grad_enabled())
        if self.head is not None:
            assert self.norm is not None
            x = self.head(self.norm(x))  # (B, T, V)
        return x


@functools.cache
def _timed_stage() -> type:
    """A PipelineStage that adds up the host time of its compute: each forward and backward
    chunk (the schedule receives and sends outside them). A class made on first use, as the
    package it extends is imported then (see SCHEDULES)."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        busy = 0.0
        # (direction, op) -> [messages, bytes, seconds] of the P2P ops the schedule asked
        # for: the tensors crossing this stage's boundaries (shapes known) and the host time
        # it waited on them (trainer/pipeline_p2p.py); ``tags``: each op's tally by id, for
        # the schedule's works to find
        p2p: dict[tuple[str, str], Tally]
        tags: dict[int, Tally]

        def _count(self, direction: str, ops: list[dist.P2POp]) -> list[dist.P2POp]:
            for p in ops:
                acc = self.p2p.setdefault(
                    (direction, "send" if p.op is dist.isend else "recv"), [0, 0, 0.0])
                acc[0] += 1
                acc[1] += p.tensor.numel() * p.tensor.element_size()
                self.tags[id(p)] = acc
            return ops

        def get_fwd_send_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
            return self._count("forward", super().get_fwd_send_ops(*args, **kwargs))

        def get_fwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
            return self._count("forward", super().get_fwd_recv_ops(*args, **kwargs))

        def get_bwd_send_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
            return self._count("backward", super().get_bwd_send_ops(*args, **kwargs))

        def get_bwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[dist.P2POp]:
            return self._count("backward", super().get_bwd_recv_ops(*args, **kwargs))

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0

    return TimedStage


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One pipeline step on one stage, in seconds of host time."""

    busy: float  # computing: forward and backward chunks, and the loss on the last stage
    wall: float  # the whole schedule step

    @property
    def idle(self) -> float:
        return max(0.0, self.wall - self.busy)


class Pipeline:
    """This rank's stage and the schedule that runs it; :meth:`step` and :meth:`eval` take
    the whole batch (every stage of a dp group reads the same one: the first uses the ids,
    the last the targets)."""

    def __init__(self, modules: list[nn.Module], *, stage: int, stages: int, schedule: str,
                 microbatches: int, accum: int, group: dist.ProcessGroup,
                 device: torch.device,
                 scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # ``stage`` is the rank's pp coordinate and ``stages`` pp; ``modules`` its stages'
        # modules in rank_stages order (one, or the looped ones of interleaved 1F1B)
        assert microbatches >= 1, "the count a job runs: trainer/mesh.py's job_microbatches"
        self.stage, self.stages, self.microbatches = stage, stages, microbatches
        self.virtual = len(modules)
        self.schedule_name = schedule
        self.group = group
        ids = rank_stages(stage, stages, self.virtual)
        total = stages * self.virtual
        self.first, self.last = 0 in ids, total - 1 in ids
        self._scale = 1.0 / (microbatches * accum)
        from torch.distributed import pipelining

        timed = _timed_stage()
        self._stages: list[Any] = [timed(m, i, total, device, group=group)
                                   for m, i in zip(modules, ids, strict=True)]
        if schedule != LOOPED:
            assert self.virtual == 1, "gpipe and 1f1b run one stage per rank"
        cls = getattr(pipelining, SCHEDULES[schedule])
        self._schedule: Any = cls(self._stages if schedule == LOOPED else self._stages[0],
                                  n_microbatches=microbatches, loss_fn=self._loss,
                                  scale_grads=False)
        self.last_timing = StepTiming(0.0, 0.0)
        # the last step's activation traffic (PipelineEvent.p2p's dicts)
        self.last_p2p: list[dict[str, Any]] = []
        self._tags: dict[int, Tally] = {}
        for st in self._stages:
            st.p2p, st.tags = {}, self._tags
        self._loss_seconds = 0.0
        self._device = device
        # the precision's loss scale (fp16's GradScaler): the schedule's backward starts from
        # the loss this returns, as PrecisionPolicy.backward's does outside a pipeline
        self._loss_scale = scale or (lambda loss: loss)
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses (last stage)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        b, t = targets.shape
        # in fp32 even under bf16 autocast, as GPT.forward: log-softmax needs the range
        loss = F.cross_entropy(logits.float().view(b * t, -1), targets.reshape(b * t))
        self._loss_seconds += time.perf_counter() - t0
        self._losses.append(loss.detach())  # the true one: the scales below are backward's
        return self._loss_scale(loss * self._scale)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole batch; its mean loss on every stage."""
        for st in self._stages:
            st.busy, st.p2p = 0.0, {}
        self._loss_seconds = 0.0
        t0 = time.perf_counter()
        with timing_p2p(self._tags) as timed:
            self._run(self._schedule.step, x, y)
        busy = sum(st.busy for st in self._stages) + self._loss_seconds
        self.last_timing = StepTiming(busy, time.perf_counter() - t0)
        self.last_p2p = p2p_totals((st.p2p for st in self._stages), timed=timed)
        return self._mean_loss()

    @torch.no_grad()
    def eval(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, forward only, on every stage."""
        self._run(self._schedule.eval, x, y)
        self._tags.clear()  # eval's ops were tagged too, and are not timed
        return self._mean_loss()

    def _run(self, call: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        self._losses = []
        args = (x,) if self.first else ()
        if self.last:
            call(*args, target=y)
        else:
            call(*args)

    def _mean_loss(self) -> torch.Tensor:
        # the mean of the micro-batches' cross-entropies: the batch's. One scalar broadcast
        # per step (no host sync): every stage reports the last stage's loss
        # the last m: a schedule's first step also calls the loss once on stand-in outputs,
        # to learn the gradient's shape (PipelineStage._prepare_backward_infra)
        loss = (torch.stack(self._losses[-self.microbatches:]).mean() if self.last
                else torch.zeros((), device=self._device))
        # the last stage is on the last pp rank, looped or not: (pp * v - 1) % pp = pp - 1
        dist.broadcast(loss, group=self.group, group_src=self.stages - 1)
        return loss


def split_model(model: GPT, *, stage: int, stages: int, virtual: int = 1, tp: int = 1
                ) -> tuple[StageModule, list[StageModule]]:
    """The rank at pp coordinate ``stage`` of ``stages``: one module holding all its layers
    (what the optimizer, clipping and checkpoints see, under the full model's names) and
    the module of each of its stages (what the schedule runs; with one stage per rank, the
    same module). Its modules are ``model``'s, not copies; ``tp`` > 1: already tensor
    parallel (StageModule's ``seq_shards``)."""
    ids, total = rank_stages(stage, stages, virtual), stages * virtual
    chunks = [StageModule(model, stage_layers(model.cfg.n_layers, total, i), first=i == 0,
                          last=i == total - 1, seq_shards=tp) for i in ids]
    if virtual == 1:
        return chunks[0], chunks
    layers = [i for c in chunks for i in map(int, c.blocks)]
    whole = StageModule(model, layers, first=0 in ids, last=total - 1 in ids, seq_shards=tp)
    return whole, chunks
