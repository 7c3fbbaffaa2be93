"""ZeRO stage 1 over the mesh's dp dimension, for parameters that are DTensors (tensor or
pipeline parallel beside data parallel): each dp rank keeps AdamW's state of its share of the
parameters only, steps that share, and sends the updated values to the other dp ranks.

Why not ``ZeroRedundancyOptimizer``: it flattens parameters into buckets of plain tensors and
broadcasts them over the default group, which neither takes a DTensor (a tp shard, or FSDP2's
``replicate`` parameter over dp) nor knows the mesh's dp sub-group. Plain data parallel keeps
it (trainer/parallel.py's ``Zero1``: DDP, whose checkpoint it consolidates to one file).

The state a rank owns is a set of whole parameters (ZeRO-1's partition, as
``ZeroRedundancyOptimizer``'s: largest first onto the least-loaded rank, by local size), so the
shard is a plain AdamW over them (fused where the device has it) and checkpoints are
torch.distributed.checkpoint's of that shard: each parameter's state is written once, by its
owner, under the parameter's name, and loads onto any mesh (another dp, fsdp, one rank).

The outer optimizer holds every parameter in its param groups, as ``ZeroRedundancyOptimizer``
does, so the loop's lr schedule, clipping and fp16's GradScaler (whose overflow check reads
every gradient, the same on every dp rank after the all-reduce) see the whole model, and every
dp rank skips or steps alike.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

if TYPE_CHECKING:
    from collections.abc import Callable

# the hyper-parameters the loop (or a scheduler) may change between steps, handed to the shard
_OPTIONS = ("lr", "weight_decay", "betas", "eps")


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores of ``p``: a DTensor's local shard, or ``p`` itself."""
    return getattr(p, "_local_tensor", p)


def partition(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each of the tensors of ``sizes`` elements among ``ranks`` ranks: the
    largest first, each onto the rank with the fewest elements so far (ties: the lowest rank).
    The same on every rank of a dp group: their local shapes are equal."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW whose state is sharded over ``group`` (the dp ranks): ``shard`` steps this rank's
    parameters, then each owner broadcasts its updated local tensors, one flat buffer per
    owner and dtype, all in flight at once."""

    def __init__(self, groups: list[dict[str, Any]], *, group: dist.ProcessGroup, lr: float,
                 betas: tuple[float, float], **kernel: bool) -> None:
        super().__init__(groups, {"lr": lr, "betas": betas, "weight_decay": 0.0, "eps": 1e-8})
        self.group = group
        self.rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        params = [p for g in self.param_groups for p in g["params"]]
        if len(params) < ranks:
            raise ValueError(f"parallel.strategy zero1 shards whole parameters over dp = "
                             f"{ranks} ranks, and this model has {len(params)}; use ddp or "
                             "fsdp")
        owner = dict(zip(map(id, params), partition([local(p).numel() for p in params], ranks),
                         strict=True))
        # the outer group of each of the shard's groups (a shard has no empty group: DCP
        # refuses them)
        self._mine: list[dict[str, Any]] = []
        shard_groups = []
        for g in self.param_groups:
            own = [p for p in g["params"] if owner[id(p)] == self.rank]
            if own:
                self._mine.append(g)
                shard_groups.append({**{k: g[k] for k in _OPTIONS}, "params": own})
        self.shard = torch.optim.AdamW(shard_groups, lr=lr, betas=betas, **kernel)
        # what each owner sends, by dtype: (owner, dtype) -> parameters, in group order
        self._sends: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            self._sends.setdefault((owner[id(p)], p.dtype), []).append(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        assert closure is None, "ShardedAdamW takes no closure"
        for outer, inner in zip(self._mine, self.shard.param_groups, strict=True):
            inner.update({k: outer[k] for k in _OPTIONS})
        self.shard.step()
        pending = []
        for (owner, _), params in self._sends.items():
            tensors = [local(p) for p in params]
            flat = _flatten_dense_tensors(tensors)  # a copy: the owner's values, or room
            work = dist.broadcast(flat, group=self.group, group_src=owner, async_op=True)
            pending.append((work, flat, tensors, owner))
        for work, flat, tensors, owner in pending:
            work.wait()
            if owner != self.rank:
                for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                    t.copy_(new)

    def state_dict(self) -> dict[str, Any]:
        raise TypeError("ShardedAdamW's state is its shard's: checkpoint .shard through "
                        "torch.distributed.checkpoint (trainer/parallel.py does)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError("ShardedAdamW's state is its shard's: load .shard through "
                        "torch.distributed.checkpoint (trainer/parallel.py does)")


def held(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state, which a sharded checkpoint saves: ZeRO-1's
    shard (a ShardedAdamW's, or ZeroRedundancyOptimizer's local one), else ``opt``."""
    if isinstance(opt, ShardedAdamW):
        return opt.shard
    zero = sys.modules.get("torch.distributed.optim")  # imported by the strategy using it
    if zero is not None and isinstance(opt, zero.ZeroRedundancyOptimizer):
        return opt.optim
    return opt


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (a DTensor's: its local shard's)."""
    return sum(local(v).numel() * v.element_size()
               for state in held(opt).state.values() for v in state.values()
               if isinstance(v, torch.Tensor))
