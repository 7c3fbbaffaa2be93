"""The one DDP communication hook: a switchable compression method, measured as it runs."""

# No ``from __future__ import annotations`` here: DDP inspects comm_hook's annotations and
# accepts only the real objects (dist.GradBucket, Future[Tensor]), not their strings.

import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from traind.trainer.collectives import Clock, CollectiveLog, UntimedLog, clock_for
from traind.trainer.compression._base import Channel, Compressor, Steps
from traind.trainer.compression._registry import METHODS
from traind.trainer.config import CompressionConfig

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True, slots=True)
class CommStats:
    """One rank's gradient communication over a window of steps, summed: exactly the numeric
    fields of :class:`traind.contracts.events.CommEvent`.

    - ``raw_bytes``: gradient bytes handed to the hook (bucket buffers, before compression),
      measured.
    - ``sent_bytes``: bytes this rank sends on the wire, *modelled*: summed over every
      collective a method issued, the bytes it handed torch.distributed (measured, as
      ``collectives`` reports them) times its ring algorithm's share (``_math.WIRE_BYTES``):
      2 (N-1)/N for all-reduce, (N-1)/N for all-to-all, N-1 for all-gather. Plain fp32 sends
      2 (N-1)/N x raw_bytes, so ``raw/sent`` is the compression ratio only at 2 ranks; at
      any N it is ``allreduce_wire_bytes(raw, N) / sent``. The tests check both halves: the
      measured bytes are what torch.distributed was handed, and these are their model.
    - ``rel_error``: sqrt(sum ||x_hat - x||²) / sqrt(sum ||x||²) over the lossy buckets of the
      window, where x is this rank's input to compression (gradient + residual with error
      feedback) and x_hat its local decompression. Local on purpose: comparing against the
      exact average would cost another all-reduce per bucket. 0 for none; int8/topk add the
      second phase's error on the shard this rank owns; for powersgd it is measured against
      the averaged result, so it includes rank disagreement (see _powersgd).
    - ``hook_seconds``: host time compressing and decompressing (on CUDA: launch time only).
    - ``allreduce_seconds``: the time some gradient collective was in flight: the union of
      every collective's interval on the device's clock (CPU: host stamps; CUDA: stream
      events), see :mod:`traind.trainer.collectives`.
    - ``collectives``: the window's collectives, every one a method issued (PowerSGD's P and
      Q separately), by op and message size, binned (see
      :class:`traind.trainer.collectives.CollectiveLog`); their ``bytes`` are measured: what
      this rank handed torch.distributed (an all-gather's input, not its output).
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

    One path on every device: the hook compresses a bucket, issues its collectives and returns
    DDP a future at once; what follows (a method's later collectives, the decompression) runs
    in the collectives' callbacks, so backward overlaps with communication on gloo as on NCCL.
    ``compression.debug_wait`` makes it wait for each bucket inside backward (serialized; for
    debugging only). ``clock``: where collectives are stamped (default: host stamps on CPU,
    CUDA events on CUDA; tests inject a fake event clock); ``timed=False``: no collective is
    stamped or reported (``telemetry.collectives``).

    ``loss_scale``: set by the trainer to a callable returning the fp16 GradScaler's current
    scale (a 0-dim device tensor, or None); residuals are then kept in true units.
    """

    def __init__(self, cfg: CompressionConfig, process_group: dist.ProcessGroup | None = None,
                 *, clock: Clock | None = None, timed: bool = True) -> None:
        self.cfg = cfg
        self.group = process_group
        self.steps_done = 0  # training steps completed since the hook was built
        self.loss_scale: Callable[[], torch.Tensor | None] | None = None
        self._compressor: Compressor = METHODS[cfg.method](cfg, process_group, step=0)
        self._names: dict[int, str] = {}  # parameter id -> name, set by register()
        self._lock = threading.Lock()  # async callbacks run on the backend's threads
        self._in_step = 0  # buckets started in the current step
        # wall time (host) this rank's first bucket of the current step came to the hook: its
        # arrival at the step's collectives, where a straggler keeps the others waiting
        self.arrived: float | None = None
        self._log = CollectiveLog(clock) if timed else UntimedLog(clock)
        # done when the previous bucket has issued its last collective (see Channel)
        self._gate: torch.futures.Future[None] = _done()
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
        """Restore the residuals, when the checkpoint was written under this hook's method and
        settings. The job's configuration decides the method, never the checkpoint: a forked
        trial of a compression arm resumes from a checkpoint written without compression (it
        used to take that checkpoint's ``none`` and train uncompressed, so every forked
        compression arm measured plain all-reduce), and a promoted setting comes back from the
        control file after a restart (``trainer/loop.py``). Residuals of another method are
        gradient that method owed: dropped, as a switch drops them (``set_method``)."""
        if state.get("method") == self.method and state.get("cfg") == self.cfg.model_dump():
            self._compressor.load_state_dict(state["residuals"], self._names)

    @property
    def world(self) -> int:
        """Ranks in the gradient group (dp's, on a mesh): what the wire models count."""
        return self._compressor.world

    def take_stats(self) -> CommStats:
        """Stats since the last call, and a fresh window (one host sync, for the error sums)."""
        with self._lock:
            err = float(self._err_sq) if self._err_sq is not None else 0.0
            ref = float(self._ref_sq) if self._ref_sq is not None else 0.0
            counts = (self._steps, self._buckets, self._raw, self._sent, self._hook_s)
            self._reset_window()
        # Outside the lock: reading CUDA timing events must not hold up callback threads.
        collectives, busy = self._log.take_window()
        return CommStats(
            steps=counts[0], buckets=counts[1], raw_bytes=counts[2], sent_bytes=counts[3],
            rel_error=(err / ref) ** 0.5 if ref > 0 else 0.0, hook_seconds=counts[4],
            allreduce_seconds=busy, collectives=tuple(collectives))

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
        self._hook_s = 0.0
        # 0-dim device tensors: summed without reading them on the host until take_stats
        self._err_sq: torch.Tensor | None = None
        self._ref_sq: torch.Tensor | None = None

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        if self._log.clock is None:
            self._log.clock = clock_for(buf.device.type)
        with self._lock:
            self._in_step += 1
            if self._in_step == 1:
                self.arrived = time.time()
        compressor = self._compressor
        prev, gate = self._gate, torch.futures.Future[None]()
        self._gate = gate
        scale = self.loss_scale() if self.loss_scale is not None else None
        ch = Channel(self.group, compressor.world, compressor.rank, self._log, gate, scale)
        # CUDA-aware on CUDA: DDP's wait then orders its stream after the decompression
        result: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[buf.device]) if buf.is_cuda
            else torch.futures.Future())
        run = _Run(self, compressor.send(bucket, ch), ch, result,
                   buf.numel() * buf.element_size(), bucket.is_last())
        # Starts now if the previous bucket has issued all its collectives, else from the
        # callback that issues its last one: one order of collectives on every rank.
        prev.add_done_callback(lambda _: run.advance(None))
        if self.cfg.debug_wait:
            result.wait()
        return result

    def _record(self, ch: Channel, raw: int, last: bool, hook_s: float) -> None:
        with self._lock:
            self._buckets += 1
            self._raw += raw
            self._sent += ch.sent_bytes
            self._hook_s += hook_s
            if ch.err_sq is not None and ch.ref_sq is not None:
                e, r = ch.err_sq.detach(), ch.ref_sq.detach()
                self._err_sq = e if self._err_sq is None else self._err_sq + e
                self._ref_sq = r if self._ref_sq is None else self._ref_sq + r
                self._block = [e, r] if self._block is None else [self._block[0] + e,
                                                                  self._block[1] + r]
            if last:  # the step's final bucket is done: the step's communication is complete
                self._steps += 1
                self.steps_done += 1
                self._in_step = 0


class _Run:
    """One bucket's ``Compressor.send`` driven through its collectives' futures: each resume
    runs until the method yields the next future it waits for, and resumes in its callback."""

    def __init__(self, hook: CompressionHook, steps: Steps, ch: Channel,
                 result: torch.futures.Future[torch.Tensor], raw: int, last: bool) -> None:
        self.hook, self.steps, self.ch, self.result = hook, steps, ch, result
        self.raw, self.last = raw, last
        self.hook_s = 0.0

    def advance(self, done: torch.futures.Future[Any] | None) -> None:
        t0 = time.perf_counter()
        try:
            if done is not None:
                done.value()  # raises here if the collective failed
            waiting = self.steps.send(None)
        except StopIteration as stop:
            self.hook_s += time.perf_counter() - t0
            self.ch.open_gate()
            self.hook._record(self.ch, self.raw, self.last, self.hook_s)
            self.result.set_result(stop.value)
            return
        except Exception as exc:  # handed to DDP, which raises it in backward
            self.ch.open_gate()  # later buckets must not hang behind this one
            self.result.set_exception(exc)  # type: ignore[arg-type]  # torch's stub says T
            return
        self.hook_s += time.perf_counter() - t0
        if self.ch.gate_ready:
            self.ch.open_gate()  # after the resume: the next bucket starts outside this one
        waiting.add_done_callback(self.advance)


def _done() -> torch.futures.Future[None]:
    fut: torch.futures.Future[None] = torch.futures.Future()
    fut.set_result(None)
    return fut


def comm_hook(state: CompressionHook,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The function DDP calls: ``ddp_model.register_comm_hook(hook, comm_hook)``."""
    return state(bucket)
