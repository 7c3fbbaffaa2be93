"""Per-group gradient statistics for the adaptive-precision policy, in one pass.

Each step the policy's ``SNRTracker`` folds every parameter's gradient into an elementwise
running mean and M2 (Welford), and once per window it reduces them per parameter group to
``signal = sum mean²`` and ``sum M2``. In PyTorch that is four foreach passes with two
temporaries per step plus two norm passes per window. The kernel does one pass over all the
gradients (one launch for every parameter, through a table of pointers): it updates mean and
M2 in place and leaves per-chunk partial sums of mean² and M2, which become the per-group
sums. The twin is the tracker's own code.
"""

from __future__ import annotations

import torch

from traind.kernels import _dispatch


def welford_update_torch(grads: list[torch.Tensor], mean: list[torch.Tensor],
                         m2: list[torch.Tensor], count: int, group_of: torch.Tensor,
                         n_groups: int) -> torch.Tensor:
    """Fold ``grads`` (step ``count``, 1-based) into ``mean`` and ``m2`` in place; return the
    per-group ``(sum mean², sum M2)`` as (2, n_groups) float32."""
    delta = torch._foreach_sub(grads, mean)  # g - mean_{n-1}
    torch._foreach_add_(mean, delta, alpha=1.0 / count)
    delta_new = torch._foreach_sub(grads, mean)  # g - mean_n
    torch._foreach_addcmul_(m2, delta, delta_new)  # M2 += (g-m_{n-1})(g-m_n)
    mean_sq = torch.stack(torch._foreach_norm(mean)).square()
    m2_sum = torch.stack(torch._foreach_norm(m2, ord=1))  # M2 >= 0: L1 norm is its sum
    device = mean_sq.device
    signal = torch.zeros(n_groups, device=device).index_add_(0, group_of, mean_sq)
    m2_total = torch.zeros(n_groups, device=device).index_add_(0, group_of, m2_sum)
    return torch.stack((signal, m2_total))


@torch.library.custom_op("traind::welford_update", mutates_args=("mean", "m2"))
def welford_update_op(grads: list[torch.Tensor], mean: list[torch.Tensor],
                      m2: list[torch.Tensor], count: int, group_of: torch.Tensor,
                      n_groups: int) -> torch.Tensor:
    mod = _dispatch.triton_module("_grad_stats_triton")
    return mod.welford_update(grads, mean, m2, count, group_of,
                              n_groups)


@welford_update_op.register_fake
def _(grads: list[torch.Tensor], mean: list[torch.Tensor], m2: list[torch.Tensor], count: int,
      group_of: torch.Tensor, n_groups: int) -> torch.Tensor:
    return group_of.new_empty((2, n_groups), dtype=torch.float32)


def welford_update(grads: list[torch.Tensor], mean: list[torch.Tensor], m2: list[torch.Tensor],
                   count: int, group_of: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The fused pass on CUDA, the twin elsewhere. ``grads`` float32 like ``mean`` and
    ``m2`` (contiguous); ``group_of[i]`` is the group of tensor i."""
    if not (len(grads) == len(mean) == len(m2) == group_of.numel()):
        raise ValueError("grads, mean, m2 and group_of must have one entry per tensor")
    if count < 1:
        raise ValueError(f"count is the 1-based step in the window, got {count}")
    if grads and _dispatch.use_triton(mean[0]):
        return welford_update_op(grads, mean, m2, count, group_of,
                                 n_groups)
    return welford_update_torch(grads, mean, m2, count, group_of, n_groups)
