"""RMSNorm forward and backward, fused (the model's ``attn_norm``, ``mlp_norm`` and ``norm``).

``y = x / sqrt(mean(x², -1) + eps) * weight``, statistics in fp32 whatever x's dtype. The
twin is ``F.rms_norm``, which is what ``nn.RMSNorm`` runs. The kernel's forward also returns
the per-row ``rstd`` (fp32), so the backward reads x, dy and rstd once and recomputes nothing
but the normalised row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from traind.kernels import _dispatch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),), weight, eps)


@torch.library.custom_op("traind::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y like x, rstd f32 x.shape[:-1])``."""
    mod = _dispatch.triton_module("_rmsnorm_triton")
    return mod.forward(x, weight, eps)


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("traind::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx like x, dweight like weight)``."""
    mod = _dispatch.triton_module("_rmsnorm_triton")
    return mod.backward(dy, x, weight, rstd)


@rms_norm_backward_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, None]:
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: the fused kernel on CUDA, ``F.rms_norm`` elsewhere."""
    if _dispatch.use_triton(x):
        y, _ = rms_norm_op(x, weight, eps)
        return y
    return rms_norm_torch(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters, same state_dict keys) whose forward dispatches.

    The model feeds it the fp32 residual stream, so the kernel's output dtype (x's) is what
    ``nn.RMSNorm`` gives under autocast too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or len(self.normalized_shape) != 1 or not _dispatch.use_triton(x):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)
