"""Gradient compression as one DDP communication hook, switchable between steps.

Methods (``compression.method``): ``none`` (fp32 all-reduce), ``fp16`` / ``bf16`` (cast,
all-reduce, cast back), ``int8`` (blockwise absmax, all-gather), ``topk`` (largest
magnitudes, all-gather), ``powersgd`` (torch's low-rank hook). int8 and topk carry what they
lose into the next step (error feedback) when ``compression.error_feedback`` is on.

Usage on every rank, after ``init_process_group``::

    hook = CompressionHook(cfg.compression)          # process_group=None: the default group
    hook.register(ddp_model)                          # once; DDP allows one hook
    ...                                               # each step: forward, backward, step
    stats = hook.take_stats()                         # CommStats over the steps since last
    hook.set_method("topk", topk_ratio=0.05)          # between steps: A/B arms

Layout: ``_math`` holds the pure functions (tested without processes), ``_base`` the
``Compressor`` base class, one module per family of methods, ``_hook`` the DDP hook.
"""

from traind.trainer.compression._base import Compressor, Residuals, Sent
from traind.trainer.compression._hook import CommStats, CompressionHook, comm_hook
from traind.trainer.compression._math import (
    Feedback,
    allgather_wire_bytes,
    allreduce_wire_bytes,
    dequantize_int8,
    error_feedback,
    quantize_int8,
    squared_error,
    topk_compress,
    topk_count,
    topk_decompress,
)
from traind.trainer.compression._registry import METHODS

__all__ = [
    "METHODS",
    "CommStats",
    "CompressionHook",
    "Compressor",
    "Feedback",
    "Residuals",
    "Sent",
    "allgather_wire_bytes",
    "allreduce_wire_bytes",
    "comm_hook",
    "dequantize_int8",
    "error_feedback",
    "quantize_int8",
    "squared_error",
    "topk_compress",
    "topk_count",
    "topk_decompress",
]
