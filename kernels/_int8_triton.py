"""Triton kernels for :mod:`traind.kernels.int8` (one program per scale block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from traind.kernels import _dispatch
from traind.kernels._triton_util import nan_to_zero, round_half_even


@triton.jit
def _quantize_ef_kernel(g_ptr, r_ptr, q_ptr, scale_ptr, r_out_ptr, err_ptr, ref_ptr, n, block,
                        HAS_R: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    idx = pid.to(tl.int64) * block + offs
    mask = (offs < block) & (idx < n)
    x = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=mask, other=0.0)
    # tl.max skips NaN where torch's amax propagates it; the scale must carry the NaN so that
    # an fp16 overflow step is still seen (and skipped) by the scaler after the gather.
    has_nan = tl.max((x != x).to(tl.int32), axis=0)
    absmax = tl.where(has_nan > 0, float("nan"), tl.max(tl.abs(x), axis=0))
    scale = tl.math.div_rn(absmax, 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    y = round_half_even(tl.math.div_rn(x, safe), INTERPRET)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    q = y.to(tl.int8)
    x_hat = q.to(tl.float32) * scale
    residual = nan_to_zero(x - x_hat)
    tl.store(q_ptr + idx, q, mask=mask)
    tl.store(scale_ptr + pid, scale)
    tl.store(r_out_ptr + idx, residual, mask=mask)
    ref = nan_to_zero(x)
    tl.store(err_ptr + pid, tl.sum(residual * residual, axis=0))
    tl.store(ref_ptr + pid, tl.sum(ref * ref, axis=0))


def quantize_ef(
    g: torch.Tensor, residual: torch.Tensor | None, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = g.contiguous()
    n = g.numel()
    nb = -(-n // block)
    q = _dispatch.new_output((n,), torch.int8, g.device)
    scales = _dispatch.new_output((nb,), torch.float32, g.device)
    new_residual = _dispatch.new_output((n,), torch.float32, g.device)
    partials = _dispatch.new_output((2, nb), torch.float32, g.device)  # (err, ref) per block
    if n:
        r = residual.contiguous() if residual is not None else g  # g: an unread placeholder
        _quantize_ef_kernel[(nb,)](
            g, r, q, scales, new_residual, partials[0], partials[1], n, block,
            HAS_R=residual is not None, BLOCK=triton.next_power_of_2(block),
            INTERPRET=_dispatch.interpreting())
    # two sums, not one unbound: a custom op's outputs may not alias each other
    return q, scales, new_residual, partials[0].sum(), partials[1].sum()


@triton.jit
def _dequantize_accumulate_kernel(q_ptr, scale_ptr, out_ptr, n, nb, block, row_stride, q_offset,
                                  world, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    idx = pid.to(tl.int64) * block + offs
    mask = (offs < block) & (idx < n)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(world):  # in rank order, as the twin adds them
        s = tl.load(scale_ptr + r * nb + pid)
        q = tl.load(q_ptr + r * row_stride + q_offset + idx, mask=mask, other=0)
        total += q.to(tl.float32) * s
    tl.store(out_ptr + idx, tl.math.div_rn(total, tl.full((BLOCK,), world, tl.float32)), mask=mask)


def dequantize_accumulate(rows: torch.Tensor, n: int, block: int) -> torch.Tensor:
    world = rows.size(0)
    nb = -(-n // block)
    rows = rows.contiguous()
    # The scales sit at unaligned byte offsets in rows past the first; one small copy
    # (4·nb·world bytes) aligns them for float loads.
    scales = rows[:, : 4 * nb].flatten().view(torch.float32).view(world, nb)
    q = rows.view(torch.int8)
    out = _dispatch.new_output((n,), torch.float32, rows.device)
    if n:
        _dequantize_accumulate_kernel[(nb,)](
            q, scales, out, n, nb, block, rows.stride(0), 4 * nb, world,
            BLOCK=triton.next_power_of_2(block))
    return out
