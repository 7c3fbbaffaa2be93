"""Blockwise int8 quantization with error feedback, fused (the ``int8`` compression hook).

The twin is the trainer's ``error_feedback(g, residual, quantize_int8, dequantize_int8)``
followed by ``squared_error(x, x_hat)``, written out here (kernels import only torch) and held
to it bit for bit by the tests. The Triton kernel does all of it in one read of the bucket and
the residual: int8 values, per-block scales, the new residual, and the two squared norms the
hook reports (as per-block partial sums, added up on the device).

The inverse, :func:`dequantize_accumulate`, turns ``(world, 4·nb + n)`` byte rows, one per
rank (what the hook's all-to-all brings each shard's owner), back into the mean over ranks in
one pass instead of ``world`` dequantize-and-add passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from traind.kernels import _dispatch

INT8_MAX = 127  # symmetric range, as in trainer/compression/_math.py


def n_blocks(n: int, block: int) -> int:
    return -(-n // block)


# -- the twins -------------------------------------------------------------------------------


def quantize_ef_torch(
    g: torch.Tensor, residual: torch.Tensor | None, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q int8 (n,), scales f32 (nb,), new_residual f32 (n,), err_sq, ref_sq)`` for the
    bucket ``g`` (n,) plus the carried ``residual``: what the trainer's code computes."""
    x = g.float() if residual is None else g.float() + residual
    n, nb = x.numel(), n_blocks(x.numel(), block)
    blocks = F.pad(x, (0, nb * block - n)).view(nb, block)  # (nb, block)
    scales = blocks.abs().amax(dim=1) / INT8_MAX  # (nb,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    q = q.view(-1)[:n]
    x_hat = (F.pad(q.float(), (0, nb * block - n)).view(nb, block) * scales[:, None]).view(-1)[:n]
    new_residual = torch.nan_to_num(x - x_hat, nan=0.0, posinf=0.0, neginf=0.0)
    diff = torch.nan_to_num(x_hat - x, nan=0.0, posinf=0.0, neginf=0.0)
    ref = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return q, scales, new_residual, diff.square().sum(), ref.square().sum()


def dequantize_accumulate_torch(rows: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Mean over ranks of the gathered int8 payloads; ``rows``: (world, 4·nb + n) uint8, each
    ``[scales as bytes | q as bytes]``. Returns float32 (n,)."""
    world, nb = rows.size(0), n_blocks(n, block)
    total = torch.zeros(n, dtype=torch.float32, device=rows.device)
    for r in range(world):
        # clone: row r starts at byte r·(4 nb + n), not always 4-aligned for a float view
        scales = rows[r, : 4 * nb].clone().view(torch.float32)
        q = F.pad(rows[r, 4 * nb :].view(torch.int8).float(), (0, nb * block - n))
        total += (q.view(nb, block) * scales[:, None]).view(-1)[:n]
    return total.div_(world)


# -- the custom ops (torch.compile sees them as opaque, shape-known calls) ---------------------


@torch.library.custom_op("traind::int8_quantize_ef", mutates_args=())
def int8_quantize_ef(
    g: torch.Tensor, residual: torch.Tensor | None, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mod = _dispatch.triton_module("_int8_triton")
    return mod.quantize_ef(g, residual, block)


@int8_quantize_ef.register_fake
def _(g: torch.Tensor, residual: torch.Tensor | None, block: int) -> tuple[torch.Tensor, ...]:
    n = g.numel()
    f32 = torch.float32
    return (g.new_empty(n, dtype=torch.int8), g.new_empty(n_blocks(n, block), dtype=f32),
            g.new_empty(n, dtype=f32), g.new_empty((), dtype=f32), g.new_empty((), dtype=f32))


@torch.library.custom_op("traind::int8_dequantize_accumulate", mutates_args=())
def int8_dequantize_accumulate(rows: torch.Tensor, n: int, block: int) -> torch.Tensor:
    mod = _dispatch.triton_module("_int8_triton")
    return mod.dequantize_accumulate(rows, n, block)


@int8_dequantize_accumulate.register_fake
def _(rows: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return rows.new_empty(n, dtype=torch.float32)


# -- dispatch --------------------------------------------------------------------------------


def quantize_ef(
    g: torch.Tensor, residual: torch.Tensor | None, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scales, new_residual, err_sq, ref_sq)``: the Triton kernel on CUDA, else the twin."""
    if g.dim() != 1:
        raise ValueError(f"quantize_ef takes a 1-D tensor, got shape {tuple(g.shape)}")
    if block <= 0:
        raise ValueError(f"int8 block must be positive, got {block}")
    if _dispatch.use_triton(g):
        return int8_quantize_ef(g, residual, block)
    return quantize_ef_torch(g, residual, block)


def dequantize_accumulate(rows: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Mean over the gathered ranks' payloads, float32 (n,): the kernel on CUDA, else the twin."""
    if rows.dim() != 2 or rows.size(1) != 4 * n_blocks(n, block) + n:
        raise ValueError(f"rows of shape {tuple(rows.shape)} do not hold {n} values in "
                         f"blocks of {block}")
    if _dispatch.use_triton(rows):
        return int8_dequantize_accumulate(rows, n, block)
    return dequantize_accumulate_torch(rows, n, block)
