"""Triton kernels for :mod:`traind.kernels.rmsnorm` (a row of D features per step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from traind.kernels import _dispatch


@triton.jit
def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(y_ptr + row * D + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    D = x.size(-1)
    x2 = x.contiguous().view(-1, D)  # (rows, D)
    rows = x2.size(0)
    y = _dispatch.new_output(tuple(x.shape), x.dtype, x.device)
    rstd = _dispatch.new_output(tuple(x.shape[:-1]), torch.float32, x.device)
    if rows:
        _forward_kernel[(rows,)](x2, weight.contiguous(), y, rstd, D, eps,
                                 BLOCK_D=triton.next_power_of_2(D))
    return y, rstd


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, rows, D,
                     BLOCK_D: tl.constexpr):
    # Each program takes rows pid, pid + P, ... and keeps its share of dweight in registers,
    # written once at the end: P partial rows summed by torch instead of atomics on D floats.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    base = pid.to(tl.int64) * D  # int64: rows · D may pass 2^31
    for row in range(pid, rows, n_prog):
        off = base + cols
        base += n_prog * D
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wdy = w * dy
        c = tl.sum(x_hat * wdy, axis=0) / D
        tl.store(dx_ptr + off, ((wdy - x_hat * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    D = x.size(-1)
    x2, dy2 = x.contiguous().view(-1, D), dy.contiguous().view(-1, D)  # (rows, D)
    rows = x2.size(0)
    dx = _dispatch.new_output(tuple(x.shape), x.dtype, x.device)
    # enough programs to fill a GPU; few under the interpreter, where each is a Python loop
    n_prog = max(1, min(rows, 4 if _dispatch.interpreting() else 1024))
    dw_part = _dispatch.new_output((n_prog, D), torch.float32, x.device)
    if rows:
        _backward_kernel[(n_prog,)](dy2, x2, weight.contiguous(), rstd.contiguous(), dx,
                                    dw_part, rows, D, BLOCK_D=triton.next_power_of_2(D))
    else:
        dw_part.zero_()
    return dx, dw_part.sum(dim=0).to(weight.dtype)
