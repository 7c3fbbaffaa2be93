"""The math of gradient compression, as pure functions on 1-D tensors (no processes needed).

Each codec is a pair: ``compress(x) -> payload`` and ``decompress(payload) -> x_hat``. Error
feedback (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD") wraps any such pair: what one
step's compression lost is added to the next step's input, so over time nothing is lost, only
delayed. The byte counts of the ring collectives live here too, so the hook and the tests agree
on what "bytes on the wire" means: a model, not a measurement. What is measured is the bytes a
rank hands torch.distributed; these formulas turn that into the bytes a ring algorithm would
send. The all-reduce figure is the ring's (NCCL's trees and gloo's other algorithms for some
sizes send otherwise); the all-to-all's and all-gather's hold, averaged over ranks, for any
algorithm in which each rank receives each byte it needs once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Callable

P = TypeVar("P")

INT8_MAX = 127  # symmetric range [-127, 127]: -128 would make the grid lopsided


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8: ``x`` (n,) -> ``q`` int8 (n,) and ``scales`` float32
    (ceil(n / block),), with ``x[i] ≈ q[i] * scales[i // block]`` and
    ``|x[i] - q[i] * scale| <= scale / 2`` (round to nearest on a grid of step ``scale``)."""
    if x.dim() != 1:
        raise ValueError(f"quantize_int8 takes a 1-D tensor, got shape {tuple(x.shape)}")
    if block <= 0:
        raise ValueError(f"int8 block must be positive, got {block}")
    n = x.numel()
    n_blocks = -(-n // block)
    padded = F.pad(x.float(), (0, n_blocks * block - n))  # zeros do not change any absmax
    blocks = padded.view(n_blocks, block)  # (nb, block)
    scales = blocks.abs().amax(dim=1) / INT8_MAX  # (nb,)
    # An all-zero block has scale 0; divide by 1 there instead (its q is 0 either way).
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: float32 (n,)."""
    n, n_blocks = q.numel(), scales.numel()
    if n_blocks != -(-n // block):
        raise ValueError(f"{n_blocks} scales do not fit {n} values in blocks of {block}")
    padded = F.pad(q.float(), (0, n_blocks * block - n)).view(n_blocks, block)  # (nb, block)
    return (padded * scales[:, None].float()).view(-1)[:n]


def topk_count(numel: int, ratio: float) -> int:
    """Elements top-k keeps: ``ceil(ratio * numel)``, at least 1 (of a non-empty tensor).

    The 1e-6 slack stops binary rounding from adding one: 0.01 is stored a hair above 1/100,
    so a bare ``ceil(0.01 * 300)`` is 4, where every user means 3."""
    if not 0 < ratio <= 1:
        raise ValueError(f"topk ratio must be in (0, 1], got {ratio}")
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel - 1e-6)))


def topk_compress(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk_count(n, ratio)`` elements of ``x`` (n,) largest in magnitude: their values
    (float32) and int32 indices (int32 halves the index bytes; buckets are far below 2^31)."""
    if x.dim() != 1:
        raise ValueError(f"topk_compress takes a 1-D tensor, got shape {tuple(x.shape)}")
    k = topk_count(x.numel(), ratio)
    # sorted=False: order is irrelevant to a scatter-add and sorting costs k log k
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return x[idx].float(), idx.to(torch.int32)


def topk_decompress(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Dense float32 (numel,) with ``values`` scatter-added at ``indices``: adding, not
    assigning, so the concatenated picks of several ranks sum where they overlap."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    return out.index_add_(0, indices.long(), values.float())


class Feedback(NamedTuple, Generic[P]):
    """One error-feedback step: what to send, and what it costs."""

    payload: P  # the compressed x
    x: torch.Tensor  # the input actually compressed: g + previous residual
    x_hat: torch.Tensor  # decompress(payload): what this rank's share of the sum will be
    residual: torch.Tensor  # x - x_hat: carried into the next step


def error_feedback(
    g: torch.Tensor,
    residual: torch.Tensor | None,
    compress: Callable[[torch.Tensor], P],
    decompress: Callable[[P], torch.Tensor],
) -> Feedback[P]:
    """Compress ``g + residual`` and return the new residual ``x - x_hat``.

    By construction ``x_hat_t = g_t + r_{t-1} - r_t``, so the sum of everything sent plus the
    last residual is the sum of every gradient (telescoping). Non-finite entries (an fp16
    GradScaler's overflow steps) are sent as they are, so the scaler still sees them and skips
    the step, but are zeroed in the residual: a NaN kept there would poison every later step.
    """
    x = g.float() if residual is None else g.float() + residual
    payload = compress(x)
    x_hat = decompress(payload)
    new_residual = torch.nan_to_num(x - x_hat, nan=0.0, posinf=0.0, neginf=0.0)
    return Feedback(payload, x, x_hat, new_residual)


def squared_error(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||x_hat - x||², ||x||²)`` as 0-dim float32 tensors on x's device (no host sync: the
    hook sums them and reads them once per stats window). Non-finite entries count as 0."""
    diff = torch.nan_to_num(x_hat.float() - x.float(), nan=0.0, posinf=0.0, neginf=0.0)
    ref = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return diff.square().sum(), ref.square().sum()


def allreduce_wire_bytes(payload: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes: reduce-scatter then
    all-gather, each moving (world-1)/world of it (what NCCL and gloo's ring do)."""
    return payload * 2 * (world - 1) // world


def allgather_wire_bytes(payload: int, world: int) -> int:
    """Bytes one rank sends in a ring all-gather of its ``payload``: its chunk passes (world-1)
    hops, one of which is its own send, and it forwards world-2 chunks of the others; per rank
    that is (world-1) * payload. It grows with world size where all-reduce's does not, which
    is why int8 and topk gather only a 1/world shard each (see ``_sparse``)."""
    return payload * (world - 1)


def alltoall_wire_bytes(payload: int, world: int) -> int:
    """Bytes one rank sends in an all-to-all of its ``payload`` cut into ``world`` equal
    chunks: every chunk but its own, (world-1)/world of it."""
    return payload * (world - 1) // world


# op -> bytes one rank sends (modelled), from the bytes it hands the collective (measured): the
# one definition the hook, its tests and the benchmark use
WIRE_BYTES: dict[str, Callable[[int, int], int]] = {
    "all_reduce": allreduce_wire_bytes,
    "all_gather": allgather_wire_bytes,
    "all_to_all": alltoall_wire_bytes,
}


def shard_len(n: int, world: int) -> int:
    """Elements per rank when ``n`` is cut into ``world`` equal shards (the last ones padded
    with zeros): ``world * shard_len`` is what the two-phase methods send, < n + world."""
    return max(1, -(-n // world))


def shard_rows(x: torch.Tensor, world: int, shard: int, width: int) -> torch.Tensor:
    """``x`` (n,) as ``world`` rows of ``shard`` elements, each zero-padded to ``width``:
    (world, width). With ``width`` a multiple of the int8 block, no block straddles two
    shards, and the padding quantizes to 0."""
    rows = F.pad(x, (0, world * shard - x.numel())).view(world, shard)
    return rows if width == shard else F.pad(rows, (0, width - shard))


def unshard_rows(rows: torch.Tensor, shard: int, n: int) -> torch.Tensor:
    """Inverse of :func:`shard_rows`: (world, width) -> (n,)."""
    return rows[:, :shard].reshape(-1)[:n]


def pack_int8_rows(q: torch.Tensor, scales: torch.Tensor, world: int, shard: int,
                   block: int) -> torch.Tensor:
    """``q`` int8 (world·sb·block,) and ``scales`` (world·sb,) in the layout of
    :func:`shard_rows` (sb = ceil(shard / block)): uint8 (world, 4·sb + shard), row r
    ``[scales_r | q_r]`` as bytes, the row padding dropped (it is 0): what rank r gets."""
    sb = -(-shard // block)
    q_rows = q.view(torch.uint8).view(world, sb * block)[:, :shard]
    return torch.cat([scales.float().view(world, sb).view(torch.uint8), q_rows], dim=1)


def unpack_int8_rows(rows: torch.Tensor, shard: int, block: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8_rows`, dequantized: (w, 4·sb + shard) -> float32
    (w·shard,), each row on its own, concatenated (no sum)."""
    w, sb = rows.size(0), -(-shard // block)
    # reshape copies the strided slice (a row's scales start at byte r·width, not always
    # 4-aligned for a float view); one row is already flat, from byte 0
    scales = rows[:, :4 * sb].reshape(-1).view(torch.float32).view(w, sb)
    q = F.pad(rows[:, 4 * sb:].contiguous().view(torch.int8).float(),
              (0, sb * block - shard)).view(w, sb, block)
    return (q * scales[:, :, None]).view(w, sb * block)[:, :shard].reshape(-1)


def unscaled(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``t`` (loss-scaled, as DDP's buckets are under an fp16 GradScaler) in true units."""
    return t if scale is None else t / scale


def scaled(t: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor | None:
    """A residual kept in true units, in the current step's loss-scaled units."""
    return t if t is None or scale is None else t * scale
