"""AdamW with decoupled weight decay on matrices only, the lr schedule, and grad clipping."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from traind.trainer.dtensors import by_mesh, whole

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch.distributed import ProcessGroup

    from traind.trainer.config import OptimConfig, TrainConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW whose weight decay applies to >= 2-D parameters (matmul weights, embeddings) only.

    Norm gains (and biases, were there any) are 1-D: decaying them pulls them towards zero,
    which fights the normalisation instead of regularising (nanoGPT's configure_optimizers).
    The lr here is a placeholder: the loop sets it from :func:`lr_at` every step.
    """
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             **adamw_kernel(device))


# Devices with torch's fused AdamW kernel (one pass over each parameter, vectorised). On this
# 2-core Xeon, at the speed bench's 5M parameters, it steps in 2.6 ms against foreach's 16 ms
# alone (``python bench/optimizer.py``: 6.1x [5.8, 6.5], blocks of steps in turn), and inside a
# training step, after the backward has filled the caches, in ~8 ms against ~12 ms (clip and
# zero_grad included): 0.4% of a ~1 s step, below what bench/speed.py can resolve here. On
# CUDA it is one launch for every parameter.
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda"})


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's kernel option for parameters on ``device``: fused where torch has it, else the
    multi-tensor (foreach) path that runs everywhere. One home for the choice: every
    strategy's optimizer (ZeRO-1's shards too) takes it."""
    if device.type in FUSED_ADAMW_DEVICES:
        return {"fused": True}
    return {"foreach": True}


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Decayed (>= 2-D) and undecayed parameters, as optimizer param groups: two, or two per
    device mesh where the parameters live on several (a factory model's tp plan leaves its
    other layers plain tensors, and a fused or foreach AdamW step will not mix the kinds)."""
    params = [p for p in model.parameters() if p.requires_grad]
    parts = by_mesh(params)
    return [group for part in parts for group in (
        {"params": [p for p in part if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in part if p.dim() < 2], "weight_decay": 0.0},
    ) if group["params"] or len(parts) == 1]  # no empty group of a mesh: DCP refuses them


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (1-based): linear warm-up over
    ``optim.warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``job.steps``."""
    o = cfg.optim
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    min_lr = o.min_lr_ratio * o.lr
    span = max(1, cfg.job.steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - min_lr)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   group: ProcessGroup | None = None) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm`` (0 = no clipping) and return the norm
    before clipping as a 0-d tensor on the parameters' device.

    ``group``: the ranks holding the *other* parts of the model (a pipeline's stages); their
    squared norms are summed (one all-reduce of a scalar), so every stage clips by the whole
    model's norm. Ranks that hold the same parameters (dp replicas, whose gradients DDP has
    averaged) are not in it: their norms are one and the same.

    No ``.item()``: the scale factor is a clamped tensor, so nothing waits for the device; the
    loop reads the returned norm only on telemetry steps.
    """
    params = [p for p in params if p.grad is not None]
    parts = by_mesh(params, of=lambda p: p.grad)
    if group is None and len(parts) == 1:
        if max_norm > 0:
            return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return nn.utils.get_total_norm([p.grad for p in params], foreach=True)  # type: ignore[misc]
    # each mesh's norm taken apart and made whole, then summed in squares
    squares = torch.stack([whole(nn.utils.get_total_norm([p.grad for p in part], foreach=True)
                                 ).float().square() for part in parts]).sum()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if max_norm > 0:
        for part in parts:  # a plain 0-d coefficient scales DTensor gradients too
            nn.utils.clip_grads_with_norm_(part, max_norm, total, foreach=True)
    return total
