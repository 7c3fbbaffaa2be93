"""Top-k sparsification with error feedback (the ``topk`` compression hook).

What can be fused: the selection itself stays ``torch.topk`` (a radix select that is hard to
beat for an exact k), but everything after it, in the trainer's code four dense temporaries
(the scattered ``x_hat``, ``x - x_hat``, its ``nan_to_num`` and the squared-error terms), is
one Triton pass over ``x`` and a byte mask: the new residual and the two squared norms. Whether
that beats the plain PyTorch path end to end is measured by ``bench/kernels_gpu.py``.

The twin is the trainer's ``error_feedback(g, residual, topk_compress, topk_decompress)`` and
``squared_error(x, x_hat)``, held to it bit for bit by the tests.
"""

from __future__ import annotations

import torch

from traind.kernels import _dispatch


def topk_ef_torch(
    g: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values f32 (k,), indices int32 (k,), new_residual f32 (n,), err_sq, ref_sq)``."""
    x = g.float() if residual is None else g.float() + residual
    # sorted=False: order is irrelevant to a scatter-add and sorting costs k log k
    idx = torch.topk(x.abs(), k, sorted=False).indices
    values, indices = x[idx].float(), idx.to(torch.int32)
    x_hat = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
    x_hat.index_add_(0, indices.long(), values)
    new_residual = torch.nan_to_num(x - x_hat, nan=0.0, posinf=0.0, neginf=0.0)
    diff = torch.nan_to_num(x_hat - x, nan=0.0, posinf=0.0, neginf=0.0)
    ref = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return values, indices, new_residual, diff.square().sum(), ref.square().sum()


@torch.library.custom_op("traind::topk_ef", mutates_args=())
def topk_ef_op(
    g: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mod = _dispatch.triton_module("_topk_triton")
    return mod.topk_ef(g, residual, k)


@topk_ef_op.register_fake
def _(g: torch.Tensor, residual: torch.Tensor | None, k: int) -> tuple[torch.Tensor, ...]:
    f32 = torch.float32
    return (g.new_empty(k, dtype=f32), g.new_empty(k, dtype=torch.int32),
            g.new_empty(g.numel(), dtype=f32), g.new_empty((), dtype=f32),
            g.new_empty((), dtype=f32))


def topk_ef(
    g: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-``k`` of ``g + residual`` by magnitude with its error feedback: the fused
    residual pass on CUDA, the twin elsewhere."""
    if g.dim() != 1:
        raise ValueError(f"topk_ef takes a 1-D tensor, got shape {tuple(g.shape)}")
    if not 0 < k <= g.numel():
        raise ValueError(f"k must be in [1, {g.numel()}], got {k}")
    if _dispatch.use_triton(g):
        return topk_ef_op(g, residual, k)
    return topk_ef_torch(g, residual, k)
