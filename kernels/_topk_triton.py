"""Triton kernel for :mod:`traind.kernels.topk`: the residual pass after the selection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from traind.kernels import _dispatch
from traind.kernels._triton_util import nan_to_zero

BLOCK = 1024


@triton.jit
def _residual_kernel(x_ptr, sel_ptr, r_out_ptr, err_ptr, ref_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    sel = tl.load(sel_ptr + idx, mask=mask, other=0) != 0
    # x_hat as the twin's scatter-add into zeros builds it, so x - x_hat rounds the same way
    # (inf - inf is NaN there too, and both become 0)
    x_hat = tl.where(sel, 0.0 + x, 0.0)
    residual = nan_to_zero(x - x_hat)
    diff = nan_to_zero(x_hat - x)
    ref = nan_to_zero(x)
    tl.store(r_out_ptr + idx, residual, mask=mask)
    tl.store(err_ptr + pid, tl.sum(diff * diff, axis=0))
    tl.store(ref_ptr + pid, tl.sum(ref * ref, axis=0))


def topk_ef(
    g: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = g.float() if residual is None else g.float() + residual
    x = x.contiguous()
    n = x.numel()
    idx = torch.topk(x.abs(), k, sorted=False).indices
    values, indices = x[idx], idx.to(torch.int32)
    selected = torch.zeros(n, dtype=torch.uint8, device=x.device).index_fill_(0, idx, 1)
    nb = triton.cdiv(n, BLOCK)
    new_residual = _dispatch.new_output((n,), torch.float32, x.device)
    partials = _dispatch.new_output((2, nb), torch.float32, x.device)  # (err, ref) per block
    _residual_kernel[(nb,)](x, selected, new_residual, partials[0], partials[1], n, BLOCK=BLOCK)
    return values, indices, new_residual, partials[0].sum(), partials[1].sum()
