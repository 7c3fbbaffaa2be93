"""Per-group squared gradient norms for the adaptive-precision policy, in one pass.

Each step the policy's ``SNRTracker`` keeps every group's squared gradient norm (the sum of
``g²`` over the group's parameters); at a window's end their square roots give the mean and
the variance of the group's gradient norm over the window. In PyTorch that is a foreach norm
pass, a stack and an index_add per step. The kernel does one launch over every gradient
(through a table of pointers) that leaves one partial sum of ``g²`` per chunk of 2048
elements; the partials become the per-group sums. The twin is the plain-PyTorch version.
"""

from __future__ import annotations

import torch

from traind.kernels import _dispatch


def group_sq_norms_torch(grads: list[torch.Tensor], group_of: torch.Tensor,
                         n_groups: int) -> torch.Tensor:
    """``out[k] = sum of g²`` over the tensors ``i`` with ``group_of[i] == k``: (n_groups,)
    float32 on the gradients' device."""
    device = grads[0].device if grads else group_of.device
    out = torch.zeros(n_groups, dtype=torch.float32, device=device)
    if not grads:
        return out
    norms = torch._foreach_norm([g.float() for g in grads])  # no copy for float32 grads
    return out.index_add_(0, group_of.to(device), torch.stack(norms).square())


@torch.library.custom_op("traind::group_sq_norms", mutates_args=())
def group_sq_norms_op(grads: list[torch.Tensor], group_of: torch.Tensor,
                      n_groups: int) -> torch.Tensor:
    mod = _dispatch.triton_module("_grad_stats_triton")
    return mod.group_sq_norms(grads, group_of, n_groups)


@group_sq_norms_op.register_fake
def _(grads: list[torch.Tensor], group_of: torch.Tensor, n_groups: int) -> torch.Tensor:
    device = grads[0].device if grads else group_of.device
    return torch.empty(n_groups, dtype=torch.float32, device=device)


def group_sq_norms(grads: list[torch.Tensor], group_of: torch.Tensor,
                   n_groups: int) -> torch.Tensor:
    """The fused pass on CUDA, the twin elsewhere; ``group_of[i]`` is the group of tensor i."""
    if len(grads) != group_of.numel():
        raise ValueError("grads and group_of must have one entry per tensor")
    if grads and _dispatch.use_triton(grads[0]):
        return group_sq_norms_op(grads, group_of, n_groups)
    return group_sq_norms_torch(grads, group_of, n_groups)
