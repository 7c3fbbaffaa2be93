"""Small ``@triton.jit`` helpers shared by the kernels (imported only with them)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def round_half_even(y, INTERPRET: tl.constexpr):
    """``torch.round`` (ties to even) for |y| < 2^22.

    On the GPU libdevice's rint; the interpreter has no libdevice, so there the classic
    1.5·2^23 trick does the same rounding with two IEEE adds."""
    if INTERPRET:
        return (y + 12582912.0) - 12582912.0
    else:
        return libdevice.rint(y)


@triton.jit
def nan_to_zero(x):
    """``torch.nan_to_num(x, nan=0, posinf=0, neginf=0)``: finite values pass, the rest are 0."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)
