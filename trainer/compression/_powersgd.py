"""``powersgd``: PowerSGD (Vogels et al. 2019), after torch's ``powerSGD_hook``.

Ours rather than torch's hook for two reasons: every collective goes through the
:class:`Channel`, so the uncompressed vectors', P's and Q's all-reduces are counted and timed
one by one; and torch's hook waits for P and Q inside its future callbacks, which on gloo runs
on the backend's worker threads and can stall them. The math is torch's: the same choice of
what to compress (``_should_compress``, min compression rate 2), the same orthogonalisation,
P summed and orthogonalised, Q averaged, error feedback always on (as torch and the paper
recommend, whatever ``compression.error_feedback`` says: that knob is for int8/topk), Q kept
between steps with ``powersgd_warm_start``, and plain all-reduce before
``max(2, powersgd_start_step)`` (torch's floor: DDP rebuilds its buckets after the first
iteration, so per-bucket state is only valid from then).

Residuals (``error``) are kept in true units under an fp16 GradScaler, as int8/topk's are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    _orthogonalize,
    _should_compress,
)

from traind.trainer.compression._base import Channel, Compressor, Residuals, Steps
from traind.trainer.compression._math import scaled, squared_error, unscaled

if TYPE_CHECKING:
    import torch.distributed as dist

    from traind.trainer.config import CompressionConfig

MIN_COMPRESSION_RATE = 2  # torch's default: compress a matrix only if it halves its bytes
EPSILON = 1e-8  # added to column norms in Gram-Schmidt: an all-zero column stays finite


class PowerSGD(Compressor):
    name: ClassVar[str] = "powersgd"

    def __init__(self, cfg: CompressionConfig, group: dist.ProcessGroup | None, *,
                 step: int = 0) -> None:
        super().__init__(cfg, group, step=step)
        self.start_step = max(2, cfg.powersgd_start_step)
        # Warm-up counts training steps, not steps since the switch: early training is what
        # is sensitive to compression, and an A/B block that switches back to powersgd at step
        # 500 should not spend its first steps in plain all-reduce.
        self.iter = step
        self.error = Residuals()  # x - result per bucket (the error feedback)
        self._qs: dict[int, tuple[tuple[int, ...], list[torch.Tensor]]] = {}  # warm start

    def send(self, bucket: dist.GradBucket, ch: Channel) -> Steps:
        buf, world = bucket.buffer(), self.world
        compressing = self.iter >= self.start_step
        if bucket.is_last():
            self.iter += 1  # as torch: a step counts once its last bucket is on its way
        if not compressing:
            buf.div_(world)
            yield ch.all_reduce(buf, last=True)
            return buf
        prev = scaled(self.error.get(bucket), ch.scale)
        if prev is not None:
            buf.add_(prev)
        x = buf.clone()  # the input compressed: gradient + residual
        small, mats, ranks = [], [], []
        for t in bucket.gradients():  # views into buf, one per parameter
            n = t.shape[0] if t.dim() > 1 else 1
            m = t.numel() // n
            r = min(n, m, self.cfg.powersgd_rank)
            if t.dim() > 1 and _should_compress(n, m, r, MIN_COMPRESSION_RATE)[0]:
                mats.append(t.view(n, m))
                ranks.append(r)
            else:
                small.append(t)
        qs = self._warm_qs(bucket, mats, ranks)
        flat = torch.cat([t.reshape(-1) for t in small]) if small else None
        if flat is not None:  # the vectors and small matrices, as they are
            flat_done = ch.all_reduce(flat, last=not mats)
        ps = [mat @ q for mat, q in zip(mats, qs, strict=True)]  # (n, r) each
        if mats:
            p_flat = torch.cat([p.reshape(-1) for p in ps])
            yield ch.all_reduce(p_flat)
            offset = 0
            for i, p in enumerate(ps):  # summed over ranks: orthogonalise, then Q = M^T P
                ps[i] = p_flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                _orthogonalize(ps[i][None], EPSILON)  # in place, a batch of one
            new_qs = [mat.t() @ p for mat, p in zip(mats, ps, strict=True)]  # (m, r) each
            q_flat = torch.cat([q.reshape(-1) for q in new_qs])
            yield ch.all_reduce(q_flat, last=True)
            q_flat.div_(world)
            offset = 0
            for mat, p, q in zip(mats, ps, qs, strict=True):
                q.copy_(q_flat[offset: offset + q.numel()].view_as(q))  # warm start keeps it
                offset += q.numel()
                torch.matmul(p, q.t(), out=mat)  # decompress into the bucket
        if flat is not None:
            yield flat_done  # gloo may finish it after P and Q: never read it before
            flat.div_(world)
            offset = 0
            for t in small:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        # torch's error: input minus result, for the uncompressed parts too (there it is how
        # far this rank is from the average, which sums to 0 over ranks). It is all there is:
        # P is all-reduced before Q exists, so no local-only reconstruction exists, and
        # rel_error reads higher than the other methods' purely local error.
        ch.error(*squared_error(x, buf))
        # non-finite entries (an fp16 overflow step) are zeroed, as in _math.error_feedback
        self.error.put(bucket, unscaled(torch.nan_to_num(x - buf, nan=0.0, posinf=0.0,
                                                         neginf=0.0), ch.scale))
        return buf

    def _warm_qs(self, bucket: dist.GradBucket, mats: list[torch.Tensor],
                 ranks: list[int]) -> list[torch.Tensor]:
        """The bucket's Q matrices (m, r): last step's with warm start, else fresh random ones,
        the same on every rank (seeded by bucket and step, never by the rank)."""
        key = (bucket.buffer().numel(), *(id(p) for p in bucket.parameters()))
        held = self._qs.get(bucket.index())
        if self.cfg.powersgd_warm_start and held is not None and held[0] == key:
            return held[1]
        seed = bucket.index() if self.cfg.powersgd_warm_start else (
            bucket.index() * 1_000_003 + self.iter)
        gen = torch.Generator().manual_seed(seed)
        qs = []
        for mat, r in zip(mats, ranks, strict=True):
            q = torch.randn(mat.shape[1], r, generator=gen).to(mat)  # on CPU: rank-agnostic
            _orthogonalize(q[None], EPSILON)
            qs.append(q)
        self._qs[bucket.index()] = (key, qs)
        return qs

