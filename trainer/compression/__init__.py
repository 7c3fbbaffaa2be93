"""Gradient compression as one DDP communication hook, switchable between steps.

Methods (``compression.method``): ``none`` (fp32 all-reduce), ``fp16`` / ``bf16`` (cast,
all-reduce, cast back), ``int8`` (blockwise absmax) and ``topk`` (largest magnitudes), both
in two phases (all-to-all of shards, reduce, all-gather), ``powersgd`` (low-rank, after
torch's hook). int8 and topk carry what they lose into the next step (error feedback) when
``compression.error_feedback`` is on; powersgd always does. Residuals are in true units
under an fp16 GradScaler (the trainer sets ``hook.loss_scale``).

Usage on every rank, after ``init_process_group``::

    hook = CompressionHook(cfg.compression)          # process_group=None: the default group
    hook.register(ddp_model)                          # once; DDP allows one hook
    ...                                               # each step: forward, backward, step
    stats = hook.take_stats()                         # CommStats over the steps since last
    hook.set_method("topk", topk_ratio=0.05)          # between steps: A/B arms

Layout: ``_math`` holds the pure functions (tested without processes), ``_base`` the
``Compressor`` base class and the ``Channel`` every collective goes through, one module per
family of methods, ``_hook`` the DDP hook (one asynchronous path on gloo and NCCL).
"""

from traind.trainer.compression._base import Channel, Compressor, Residuals
from traind.trainer.compression._hook import CommStats, CompressionHook, comm_hook
from traind.trainer.compression._math import (
    WIRE_BYTES,
    Feedback,
    allgather_wire_bytes,
    allreduce_wire_bytes,
    alltoall_wire_bytes,
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
    "WIRE_BYTES",
    "Channel",
    "CommStats",
    "CompressionHook",
    "Compressor",
    "Feedback",
    "Residuals",
    "allgather_wire_bytes",
    "allreduce_wire_bytes",
    "alltoall_wire_bytes",
    "comm_hook",
    "dequantize_int8",
    "error_feedback",
    "quantize_int8",
    "squared_error",
    "topk_compress",
    "topk_count",
    "topk_decompress",
]
