"""All-reduce methods: ``none`` (fp32, exact) and the casts ``fp16`` / ``bf16``."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from traind.trainer.compression._base import Compressor, Sent
from traind.trainer.compression._math import allreduce_wire_bytes, squared_error


class NoCompression(Compressor):
    """Plain averaged all-reduce, the null member: what DDP does without a hook."""

    name: ClassVar[str] = "none"

    def send(self, bucket: dist.GradBucket) -> Sent:
        buf = bucket.buffer()
        buf.div_(self.world)  # divide first, as DDP does: the sum of N fp16 grads can overflow
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        assert work is not None
        return Sent(work.get_future(), lambda: buf,
                    allreduce_wire_bytes(buf.numel() * buf.element_size(), self.world))


class _CastCompressor(Compressor):
    """Cast to a 16-bit type, all-reduce in it, cast back. torch ships ``bf16_compress_hook``
    but it needs NCCL (gloo's bf16 sum is recent); this one runs on both."""

    dtype: ClassVar[torch.dtype]

    def send(self, bucket: dist.GradBucket) -> Sent:
        buf = bucket.buffer()
        world = self.world
        # divide before the cast: fp16 tops out at 65504, and the sum of N values is N times
        # larger. Dividing by a power of two is exact, so it costs nothing in precision.
        payload = buf.to(self.dtype).div_(world)
        # Local error, before the collective overwrites payload: the cast's rounding only.
        err_sq, ref_sq = squared_error(buf, payload.to(buf.dtype) * world)
        work = dist.all_reduce(payload, group=self.group, async_op=True)
        assert work is not None

        def finish() -> torch.Tensor:
            return buf.copy_(payload)  # decompress in place: no second bucket-sized buffer

        return Sent(work.get_future(), finish,
                    allreduce_wire_bytes(payload.numel() * payload.element_size(), world),
                    err_sq, ref_sq)


class Fp16(_CastCompressor):
    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16


class Bf16(_CastCompressor):
    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16
