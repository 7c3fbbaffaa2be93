"""``powersgd``: torch's own PowerSGD hook (Vogels et al. 2019), wrapped to be measured.

torch's hook does its own error feedback (``PowerSGDState.error_dict``, per bucket index) and
warm start (Q reused between steps); it always uses error feedback here, as torch and the
paper recommend, whatever ``compression.error_feedback`` says (that knob is for int8/topk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

from traind.trainer.compression._base import Compressor, Sent
from traind.trainer.compression._math import allreduce_wire_bytes, squared_error

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from traind.trainer.config import CompressionConfig


class PowerSGD(Compressor):
    name: ClassVar[str] = "powersgd"

    def __init__(self, cfg: CompressionConfig, group: dist.ProcessGroup | None, *,
                 step: int = 0) -> None:
        super().__init__(cfg, group, step=step)
        self.state = PowerSGDState(
            process_group=group,
            matrix_approximation_rank=cfg.powersgd_rank,
            # torch refuses < 2 with error feedback or warm start: DDP rebuilds its buckets
            # after the first iteration, so state keyed by bucket index is only valid later.
            start_powerSGD_iter=max(2, cfg.powersgd_start_step),
            use_error_feedback=True,
            warm_start=cfg.powersgd_warm_start,
        )
        # Warm-up counts training steps, not steps since the switch: early training is what
        # is sensitive to compression, and an A/B block that switches back to powersgd at step
        # 500 should not spend its first steps in plain all-reduce.
        self.state.iter = step

    def send(self, bucket: dist.GradBucket) -> Sent:
        buf = bucket.buffer()
        state, world = self.state, self.world
        compressing = state.iter >= state.start_powerSGD_iter
        x: torch.Tensor | None = None
        if compressing:  # the input torch will compress: gradient + its residual
            prev = state.error_dict.get(bucket.index())
            x = buf.clone() if prev is None or prev.numel() != buf.numel() else buf + prev
        before = state.total_numel_after_compression
        future = powerSGD_hook(state, bucket)
        # torch counts the elements it all-reduces (P, Q and the uncompressed vectors) as it
        # plans the bucket, before the first collective: read them here, on the host.
        elements = state.total_numel_after_compression - before if compressing else buf.numel()

        def finish() -> torch.Tensor:
            out = future.value()
            if x is not None:
                # The error torch keeps (x - result) is all there is: P is all-reduced before
                # Q is computed, so no local-only reconstruction exists. It therefore also
                # holds how far this rank's gradient is from the average: it reads higher
                # than the other methods' purely local error.
                sent.err_sq, sent.ref_sq = squared_error(x, out)
            return out

        sent = Sent(future, finish, allreduce_wire_bytes(elements * buf.element_size(), world))
        return sent
