"""Methods exchanged by all-gather: ``int8`` (blockwise absmax) and ``topk`` (sparsification).

Why all-gather and not all-reduce: int8 values cannot be summed in int8 (127 + 127
overflows), and top-k picks different indices on each rank. Summing after dequantising
(all-reduce in fp32) would put 4 bytes per element on the wire again, i.e. no compression at
all; an int32 all-reduce on a shared scale also sends 4 bytes. So each rank sends its
compressed payload and every rank decompresses all of them. The price is honest in the byte
count: a ring all-gather sends (world-1) x payload per rank against all-reduce's
2 (world-1)/world, so these methods win at 2 ranks and lose their edge around 8.

Each payload is packed into one tensor, so a bucket costs one collective, not two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from traind.kernels import int8 as int8_kernels
from traind.kernels import topk as topk_kernels
from traind.trainer.compression._base import Compressor, Residuals, Sent
from traind.trainer.compression._math import allgather_wire_bytes, topk_count, topk_decompress

if TYPE_CHECKING:
    from traind.trainer.config import CompressionConfig


class _GatherCompressor(Compressor):
    collective: ClassVar[str] = "all_gather"

    def __init__(self, cfg: CompressionConfig, group: dist.ProcessGroup | None, *,
                 step: int = 0) -> None:
        super().__init__(cfg, group, step=step)
        self.residuals = Residuals()

    def state_dict(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        return self.residuals.state_dict(names)

    def load_state_dict(self, state: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        self.residuals.load_state_dict(state, names)

    def _gather(self, packed: torch.Tensor) -> tuple[torch.futures.Future[object],
                                                      torch.Tensor]:
        """Start the all-gather of every rank's ``packed`` (1-D); rows of the result are ranks."""
        out = packed.new_empty(self.world * packed.numel())
        # all_gather_single: torch 2.13's name for all_gather_into_tensor (one flat output,
        # no list of per-rank tensors); gloo and NCCL both implement it.
        work = dist.all_gather_single(out, packed, group=self.group, async_op=True)
        assert work is not None
        return work.get_future(), out.view(self.world, packed.numel())


class Int8(_GatherCompressor):
    name: ClassVar[str] = "int8"

    def send(self, bucket: dist.GradBucket) -> Sent:
        buf = bucket.buffer()
        n, block = buf.numel(), self.cfg.int8_block
        # error_feedback(quantize_int8, dequantize_int8) and squared_error, fused into one pass
        # on CUDA; elsewhere kernels' twin, which is that code bit for bit
        q, scales, residual, err_sq, ref_sq = int8_kernels.quantize_ef(
            buf, self.residuals.get(bucket) if self.cfg.error_feedback else None, block)
        if self.cfg.error_feedback:
            self.residuals.put(bucket, residual)
        packed = torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])  # one collective
        future, rows = self._gather(packed)  # rows: (world, 4 nb + n) bytes

        def finish() -> torch.Tensor:
            # the mean of every rank's dequantized payload, in one pass over the rows on CUDA
            return buf.copy_(int8_kernels.dequantize_accumulate(rows, n, block))

        return Sent(future, finish, allgather_wire_bytes(packed.numel(), self.world),
                    err_sq, ref_sq)


class TopK(_GatherCompressor):
    name: ClassVar[str] = "topk"

    def send(self, bucket: dist.GradBucket) -> Sent:
        buf = bucket.buffer()
        n = buf.numel()
        k = topk_count(n, self.cfg.topk_ratio)
        # error_feedback(topk_compress, topk_decompress) and squared_error; on CUDA the dense
        # passes after the selection are one fused kernel, elsewhere kernels' twin (this code)
        values, indices, residual, err_sq, ref_sq = topk_kernels.topk_ef(
            buf, self.residuals.get(bucket) if self.cfg.error_feedback else None, k)
        if self.cfg.error_feedback:
            self.residuals.put(bucket, residual)
        # values and indices are both 4 bytes: reinterpret the float bits as int32 and send
        # [values | indices] in one collective (gathers copy bits, never do arithmetic)
        packed = torch.cat([values.view(torch.int32), indices])
        future, rows = self._gather(packed)  # rows: (world, 2k) int32

        def finish() -> torch.Tensor:
            values_all = rows[:, :k].reshape(-1).view(torch.float32)  # (world·k,)
            indices_all = rows[:, k:].reshape(-1)  # (world·k,)
            total = topk_decompress(values_all, indices_all, n)
            return buf.copy_(total.div_(self.world))

        return Sent(future, finish, allgather_wire_bytes(packed.numel() * 4, self.world),
                    err_sq, ref_sq)
