"""All-reduce methods: ``none`` (fp32, exact) and the casts ``fp16`` / ``bf16``."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from traind.trainer.compression._base import Channel, Compressor, Steps
from traind.trainer.compression._math import squared_error

if TYPE_CHECKING:
    import torch.distributed as dist


class NoCompression(Compressor):
    """Plain averaged all-reduce, the null member: what DDP does without a hook."""

    name: ClassVar[str] = "none"

    def send(self, bucket: dist.GradBucket, ch: Channel) -> Steps:
        buf = bucket.buffer()
        buf.div_(self.world)  # divide first, as DDP does: the sum of N fp16 grads can overflow
        yield ch.all_reduce(buf, last=True)
        return buf


class _CastCompressor(Compressor):
    """Cast to a 16-bit type, all-reduce in it, cast back. torch ships ``bf16_compress_hook``
    but it needs NCCL (gloo's bf16 sum is recent); this one runs on both."""

    dtype: ClassVar[torch.dtype]

    def send(self, bucket: dist.GradBucket, ch: Channel) -> Steps:
        buf = bucket.buffer()
        world = self.world
        # divide before the cast: fp16 tops out at 65504, and the sum of N values is N times
        # larger. Dividing by a power of two is exact, so it costs nothing in precision.
        payload = buf.to(self.dtype).div_(world)
        # Local error, before the collective overwrites payload: the cast's rounding only.
        ch.error(*squared_error(buf, payload.to(buf.dtype) * world))
        yield ch.all_reduce(payload, last=True)
        return buf.copy_(payload)  # decompress in place: no second bucket-sized buffer


class Fp16(_CastCompressor):
    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16


class Bf16(_CastCompressor):
    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16
