"""The one DDP communication hook: a switchable compression method, measured as it runs."""

# No ``from __future__ import annotations`` here: DDP inspects comm_hook's annotations and
# accepts only the real objects (dist.GradBucket, Future[Tensor]), not their strings.

import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from traind.trainer.collectives import CollectiveLog
from traind.trainer.compression._base import Compressor, Sent, completed
from traind.trainer.compression._math import message_bytes
from traind.trainer.compression._registry import METHODS
from traind.trainer.config import CompressionConfig


@dataclass(frozen=True, slots=True)
class CommStats:
    """One rank's gradient communication over a window of steps, summed: exactly the numeric
    fields of :class:`traind.trainer.events.CommEvent`.

    - ``raw_bytes``: gradient bytes handed to the hook (bucket buffers, before compression).
    - ``sent_bytes``: bytes this rank put on the wire under the ring algorithm of the
      collective used: 2 (N-1)/N x payload for all-reduce, (N-1) x payload for all-gather. At
      2 ranks both are 1 x payload; plain fp32 sends raw_bytes. ``raw/sent`` is the ratio.
    - ``rel_error``: sqrt(sum ||x_hat - x||²) / sqrt(sum ||x||²) over the lossy buckets of the
      window, where x is this rank's input to compression (gradient + residual with error
      feedback) and x_hat its local decompression. Local on purpose: comparing against the
      exact average would cost another all-reduce per bucket. 0 for none; for powersgd it is
      measured against the averaged result, so it includes rank disagreement (see _powersgd).
    - ``hook_seconds``: host time compressing and decompressing (on CUDA: launch time only).
    - ``allreduce_seconds``: time in collectives; see ``CompressionHook(wait=...)``.
    - ``collectives``: the window's collectives by op and message size, binned (see
      :class:`traind.trainer.collectives.CollectiveLog`).
    """

    steps: int = 0
    buckets: int = 0
    raw_bytes: int = 0
    sent_bytes: int = 0
    rel_error: float = 0.0
    hook_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    collectives: tuple[dict[str, Any], ...] = ()


class CompressionHook:
    """A DDP comm hook whose method can change between steps, without rebuilding DDP.

    Register once: ``hook.register(ddp_model)`` (or ``ddp_model.register_comm_hook(hook,
    comm_hook)``). Between steps: ``hook.take_stats()`` and ``hook.set_method(...)``.

    ``wait``: True makes the hook wait for each bucket's collective inside the hook, which is
    the only exact way to time it, but backward no longer overlaps with communication. False
    returns DDP a future and decompresses in its callback; then on CPU the collective time is
    the time collectives were in flight (union of intervals), on CUDA it is not measured (0):
    the NCCL future completes at enqueue, and timing it would need a device sync per bucket.
    Default: True on CPU (gloo ranks share the cores with backward, so overlap gains little),
    False on CUDA.
    """

    def __init__(self, cfg: CompressionConfig, process_group: dist.ProcessGroup | None = None,
                 *, wait: bool | None = None) -> None:
        self.cfg = cfg
        self.group = process_group
        self.wait = wait
        self.steps_done = 0  # training steps completed since the hook was built
        self._compressor: Compressor = METHODS[cfg.method](cfg, process_group, step=0)
        self._names: dict[int, str] = {}  # parameter id -> name, set by register()
        self._lock = threading.Lock()  # async callbacks run on the backend's threads
        self._in_step = 0  # buckets started in the current step
        self._busy_until = 0.0  # end of the last collective interval (async CPU timing)
        self._log = CollectiveLog()
        self._block: list[torch.Tensor] | None = None  # [err², ref²] since take_block_error
        self._reset_window()

    @property
    def method(self) -> str:
        return self._compressor.name

    @property
    def compressor(self) -> Compressor:
        """The active method's state (residuals, PowerSGD's state): for tests and debugging."""
        return self._compressor

    def register(self, ddp_model: DistributedDataParallel) -> None:
        """Install this hook on ``ddp_model`` (DDP allows one hook, registered once)."""
        ddp_model.register_comm_hook(self, comm_hook)
        # Parameter names, for checkpoints of residuals (ids do not survive a restart).
        self._names = {id(p): n for n, p in ddp_model.module.named_parameters()}

    def set_method(self, name: str, **params: Any) -> None:
        """Switch to method ``name`` with ``params`` overriding config fields (``topk_ratio=
        0.05``, ...), at a step boundary. ``ValueError`` names the field for a bad value.

        Switching resets error-feedback residuals and PowerSGD's state: a residual is gradient
        the old method still owes, and flushing it into the new method's first step would
        charge that method for the old one's debt (a gradient spike inside arm B's block of
        an A/B test). What is dropped is bounded (see the tests). Setting the same method with
        the same values keeps everything. Call ``take_stats()`` first so a window holds one
        method.
        """
        if name not in METHODS:
            raise ValueError(f"compression.method: {name!r} is not one of {sorted(METHODS)}")
        cfg = CompressionConfig.model_validate({**self.cfg.model_dump(), **params,
                                                "method": name})
        if self._in_step:
            raise RuntimeError("set_method inside a step (some buckets already reduced with "
                               f"{self.method!r}); call it between optimizer steps")
        if cfg != self.cfg:
            self.cfg = cfg
            self._compressor = METHODS[name](cfg, self.group, step=self.steps_done)

    def state_dict(self) -> dict[str, Any]:
        """The method and its residuals, for a checkpoint (PowerSGD's own state is not kept:
        after a resume it warms up again from plain all-reduce)."""
        return {"method": self.method, "cfg": self.cfg.model_dump(),
                "residuals": self._compressor.state_dict(self._names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the method that was active and its residuals."""
        cfg = state["cfg"]
        self.set_method(state["method"], **{k: v for k, v in cfg.items() if k != "method"})
        self._compressor.load_state_dict(state["residuals"], self._names)

    def take_stats(self) -> CommStats:
        """Stats since the last call, and a fresh window (one host sync, for the error sums)."""
        with self._lock:
            err = float(self._err_sq) if self._err_sq is not None else 0.0
            ref = float(self._ref_sq) if self._ref_sq is not None else 0.0
            stats = CommStats(
                steps=self._steps, buckets=self._buckets, raw_bytes=self._raw,
                sent_bytes=self._sent, rel_error=(err / ref) ** 0.5 if ref > 0 else 0.0,
                hook_seconds=self._hook_s, allreduce_seconds=self._comm_s)
            self._reset_window()
        # Outside the lock: reading CUDA timing events must not hold up callback threads.
        return dataclasses.replace(stats, collectives=tuple(self._log.take()))

    def take_block_error(self) -> float:
        """Relative compression error since the last call (0 when lossless), for an A/B
        block's gradient-fidelity guard: its own accumulator, so a telemetry window that
        closes mid-block does not split it. One host sync (a block boundary has one anyway)."""
        with self._lock:
            block, self._block = self._block, None
        if block is None:
            return 0.0
        err, ref = float(block[0]), float(block[1])
        if not (math.isfinite(err) and math.isfinite(ref)):
            return math.nan  # non-finite gradients or compression: the guard rejects it
        return (err / ref) ** 0.5 if ref > 0 else 0.0

    def _reset_window(self) -> None:
        self._steps = self._buckets = self._raw = self._sent = 0
        self._hook_s = self._comm_s = 0.0
        # 0-dim device tensors: summed without reading them on the host until take_stats
        self._err_sq: torch.Tensor | None = None
        self._ref_sq: torch.Tensor | None = None

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        raw = buf.numel() * buf.element_size()
        last = bucket.is_last()
        wait = self.wait if self.wait is not None else buf.device.type == "cpu"
        with self._lock:
            self._in_step += 1
        op = self._compressor.collective
        t0 = time.perf_counter()
        sent = self._compressor.send(bucket)
        t1 = time.perf_counter()
        msg = message_bytes(op, sent.sent_bytes, self._compressor.world)
        if wait:
            sent.future.wait()
            t2 = time.perf_counter()
            self._log.record(op, msg, t2 - t1)
            out = sent.finish()
            self._record(sent, raw, last, hook_s=(t1 - t0) + (time.perf_counter() - t2),
                         comm_s=t2 - t1)
            return completed(out)
        cpu = buf.device.type == "cpu"
        started = None if cpu else CollectiveLog.start_event()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            t2 = time.perf_counter()
            fut.value()  # raises here if the collective failed
            if started is None:
                self._log.record(op, msg, t2 - t1)
            else:  # this callback's stream has waited for the collective: the end is here
                self._log.stop(op, msg, started)
            out = sent.finish()
            t3 = time.perf_counter()
            with self._lock:
                # collectives on one group run in order: count each instant once
                comm = max(0.0, t2 - max(t1, self._busy_until)) if cpu else 0.0
                self._busy_until = t2
            self._record(sent, raw, last, hook_s=(t1 - t0) + (t3 - t2), comm_s=comm)
            return out

        return sent.future.then(done)

    def _record(self, sent: Sent, raw: int, last: bool, *, hook_s: float,
                comm_s: float) -> None:
        with self._lock:
            self._buckets += 1
            self._raw += raw
            self._sent += sent.sent_bytes
            self._hook_s += hook_s
            self._comm_s += comm_s
            if sent.err_sq is not None and sent.ref_sq is not None:
                e, r = sent.err_sq.detach(), sent.ref_sq.detach()
                self._err_sq = e if self._err_sq is None else self._err_sq + e
                self._ref_sq = r if self._ref_sq is None else self._ref_sq + r
                self._block = [e, r] if self._block is None else [self._block[0] + e,
                                                                  self._block[1] + r]
            if last:  # the step's final bucket is done: the step's communication is complete
                self._steps += 1
                self.steps_done += 1
                self._in_step = 0


def comm_hook(state: CompressionHook,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The function DDP calls: ``ddp_model.register_comm_hook(hook, comm_hook)``."""
    return state(bucket)
