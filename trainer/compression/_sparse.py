"""Two-phase methods: ``int8`` (blockwise absmax) and ``topk`` (sparsification).

Neither can be summed on the wire: int8 values overflow in int8 (127 + 127), and top-k picks
different indices on each rank; an fp32 all-reduce of the decompressed values would send 4
bytes per element again. Gathering every rank's payload works but sends (world-1) x payload
per rank: at 8 ranks int8 would send as much as an fp32 all-reduce. So each bucket goes in two
phases, a reduce-scatter built from an all-to-all and a gather of the reduced shards:

1. compress ``g + residual`` (error feedback); cut it into ``world`` shards; an all-to-all
   hands rank r every rank's shard r, compressed;
2. rank r decompresses and averages its shard, compresses the average again and all-gathers
   it; every rank decompresses the ``world`` shards into the bucket.

Bytes per rank: (world-1)/world x payload in each phase, 2 (world-1)/world in all, what a
ring all-reduce of the compressed payload would cost. The second compression's error is kept
by the shard's owner: it is added, times ``world``, to the owner's residual at the shard's
positions, where the next step's average brings it back at weight 1/world. Then, with
``R_r`` rank r's residual, the gradient applied at step t is ``mean_r g_r,t + mean_r R_r,t-1
- mean_r R_r,t``: summed over steps nothing is lost, only delayed (the tests check this
identity across real ranks). Without error feedback both errors are dropped.

Shards: ``ceil(n / world)`` elements each; int8 gives each shard its own scale blocks (the
last block of a shard may be short: a block never has two owners), and top-k picks
``topk_count(shard, ratio)`` per shard, so each chunk of the all-to-all has one fixed size
and no count has to be exchanged first (that would be a host sync). The price is that the
picks are the largest per shard, not over the whole bucket.

Residuals are kept in true units under an fp16 GradScaler (``Channel.scale``): stored
divided by the scale of the step that made them, added back times the current one, so a
change of scale does not misweight them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from traind.kernels import int8 as int8_kernels
from traind.kernels import topk as topk_kernels
from traind.trainer.compression._base import Channel, Compressor, Residuals, Steps
from traind.trainer.compression._math import (
    pack_int8_rows,
    scaled,
    shard_len,
    shard_rows,
    topk_count,
    topk_decompress,
    unpack_int8_rows,
    unscaled,
    unshard_rows,
)

if TYPE_CHECKING:
    import torch.distributed as dist

    from traind.trainer.config import CompressionConfig


class _TwoPhase(Compressor):
    def __init__(self, cfg: CompressionConfig, group: dist.ProcessGroup | None, *,
                 step: int = 0) -> None:
        super().__init__(cfg, group, step=step)
        self.residuals = Residuals()

    def state_dict(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        return self.residuals.state_dict(names)

    def load_state_dict(self, state: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        self.residuals.load_state_dict(state, names)

    def _carried(self, bucket: dist.GradBucket, ch: Channel) -> torch.Tensor | None:
        """The bucket's residual in this step's (loss-scaled) units, or None."""
        if not self.cfg.error_feedback:
            return None
        return scaled(self.residuals.get(bucket), ch.scale)

    def _keep(self, bucket: dist.GradBucket, ch: Channel, residual: torch.Tensor,
              owned_error: torch.Tensor, shard: int) -> None:
        """Store ``residual`` (n,) with the second phase's error on this rank's shard folded
        in (times world, see the module docstring), in true units."""
        if not self.cfg.error_feedback:
            return
        lo, hi = self.rank * shard, min(residual.numel(), (self.rank + 1) * shard)
        if hi > lo:
            residual[lo:hi].add_(owned_error[: hi - lo], alpha=self.world)
        self.residuals.put(bucket, unscaled(residual, ch.scale))


class Int8(_TwoPhase):
    name: ClassVar[str] = "int8"

    def send(self, bucket: dist.GradBucket, ch: Channel) -> Steps:
        buf = bucket.buffer()
        n, block, world = buf.numel(), self.cfg.int8_block, self.world
        shard = shard_len(n, world)
        width = -(-shard // block) * block  # each shard's rows padded to whole blocks
        carried = self._carried(bucket, ch)
        # error_feedback(quantize_int8, dequantize_int8) and squared_error, fused into one pass
        # on CUDA; elsewhere kernels' twin, which is that code bit for bit. Run on the shards'
        # block-aligned layout, so each shard has its own scales.
        q, scales, residual, err_sq, ref_sq = int8_kernels.quantize_ef(
            shard_rows(buf.float(), world, shard, width).view(-1),
            None if carried is None else shard_rows(carried, world, shard, width).view(-1),
            block)
        ch.error(err_sq, ref_sq)
        packed = pack_int8_rows(q, scales, world, shard, block)  # (world, 4 sb + shard) bytes
        mine = torch.empty_like(packed)  # row j: rank j's int8 of my shard
        yield ch.all_to_all(mine, packed)
        # my shard averaged, in one pass over the rows on CUDA, and quantized again
        mean = int8_kernels.dequantize_accumulate(mine, shard, block)  # (shard,) f32
        q2, scales2, owned_error, err2, _ = int8_kernels.quantize_ef(mean, None, block)
        row = torch.cat([scales2.view(torch.uint8), q2.view(torch.uint8)])  # (4 sb + shard,)
        rows = row.new_empty(world * row.numel())
        gathered = ch.all_gather(rows, row, last=True)
        ch.error(err2, torch.zeros_like(err2))  # the shard's second rounding, this rank's part
        self._keep(bucket, ch, unshard_rows(residual.view(world, width), shard, n),
                   owned_error, shard)
        yield gathered
        return buf.copy_(unpack_int8_rows(rows.view(world, -1), shard, block)[:n])


class TopK(_TwoPhase):
    name: ClassVar[str] = "topk"

    def send(self, bucket: dist.GradBucket, ch: Channel) -> Steps:
        buf = bucket.buffer()
        n, world = buf.numel(), self.world
        shard = shard_len(n, world)
        k = topk_count(shard, self.cfg.topk_ratio)
        pad = world * shard - n
        g = F.pad(buf.float(), (0, pad)).view(world, shard)  # (world, shard)
        carried = self._carried(bucket, ch)
        r = None if carried is None else F.pad(carried, (0, pad)).view(world, shard)
        chunks, residuals = [], []
        for j in range(world):
            # error_feedback(topk_compress, topk_decompress) and squared_error; on CUDA the
            # dense passes after the selection are one fused kernel, elsewhere the twin
            values, indices, res, err_sq, ref_sq = topk_kernels.topk_ef(
                g[j], None if r is None else r[j], k)
            ch.error(err_sq, ref_sq)
            # values and indices are both 4 bytes: the float bits as int32, one collective
            chunks.append(torch.cat([values.view(torch.int32), indices]))
            residuals.append(res)
        packed = torch.stack(chunks)  # (world, 2k) int32
        mine = torch.empty_like(packed)  # row j: rank j's picks in my shard
        yield ch.all_to_all(mine, packed)
        mean = topk_decompress(mine[:, :k].reshape(-1).view(torch.float32),
                               mine[:, k:].reshape(-1), shard).div_(world)  # (shard,)
        values2, indices2, owned_error, err2, _ = topk_kernels.topk_ef(mean, None, k)
        row = torch.cat([values2.view(torch.int32), indices2])  # (2k,)
        rows = row.new_empty(world * row.numel())
        gathered = ch.all_gather(rows, row, last=True)
        ch.error(err2, torch.zeros_like(err2))
        self._keep(bucket, ch, torch.cat(residuals)[:n], owned_error, shard)
        yield gathered
        rows2 = rows.view(world, 2 * k)
        # shard-local indices -> bucket positions
        offsets = torch.arange(world, device=buf.device, dtype=torch.int32)[:, None] * shard
        total = topk_decompress(rows2[:, :k].reshape(-1).view(torch.float32),
                                (rows2[:, k:] + offsets).reshape(-1), world * shard)
        return buf.copy_(total[:n])
