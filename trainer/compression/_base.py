"""The base class every compression method implements, the channel its collectives go
through, and the per-bucket residual store."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from traind.trainer.compression._math import WIRE_BYTES

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.collectives import CollectiveLog
    from traind.trainer.config import CompressionConfig


# What a method's ``send`` is: a generator that yields the future of each collective it waits
# for and returns the averaged bucket (see Compressor.send).
Steps = Generator["torch.futures.Future[Any]", None, torch.Tensor]


class Channel:
    """One bucket's way onto the wire: every collective a method issues goes through here, so
    counting (op, message bytes, bytes sent, start/end on the log's clock) is one piece of code
    and PowerSGD's P and Q all-reduces are two calls, not one. Message bytes are measured (the
    size of the tensor handed to torch.distributed); bytes sent are modelled from them by the
    ring formulas of ``_math.WIRE_BYTES``.

    Order: gloo pairs the k-th collective of one rank with the k-th of every other, so every
    rank must issue them in one order. A method with several collectives issues its later ones
    from a callback, on a backend thread; the hook therefore starts a bucket only when the
    previous bucket has issued its last collective (``last=True``, which opens ``gate``).
    """

    def __init__(self, group: dist.ProcessGroup | None, world: int, rank: int,
                 log: CollectiveLog, gate: torch.futures.Future[None],
                 scale: torch.Tensor | None) -> None:
        self.group, self.world, self.rank = group, world, rank
        # the GradScaler's current scale (0-dim, on device) under fp16, else None: buckets
        # hold loss-scaled gradients, and residuals are kept in true units (see _math.scaled)
        self.scale = scale
        # what this rank sends on the wire for the bucket, all collectives: modelled, the
        # ring formula (WIRE_BYTES) of each message handed to torch.distributed
        self.sent_bytes = 0
        self.calls = 0
        # ||x_hat - x||² and ||x||² of this rank's input (None: lossless, nothing to add)
        self.err_sq: torch.Tensor | None = None
        self.ref_sq: torch.Tensor | None = None
        self.gate_ready = False  # the last collective is issued: open the gate after this stage
        self._log, self._gate = log, gate

    def all_reduce(self, t: torch.Tensor, *, last: bool = False) -> torch.futures.Future[Any]:
        """Sum ``t`` in place over the group."""
        return self._issue("all_reduce", t.numel() * t.element_size(), last,
                           lambda: dist.all_reduce(t, group=self.group, async_op=True))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *,
                   last: bool = False) -> torch.futures.Future[Any]:
        """Row r of ``inp`` (world, m) goes to rank r; row j of ``out`` comes from rank j."""
        return self._issue("all_to_all", inp.numel() * inp.element_size(), last,
                           lambda: dist.all_to_all_single(out, inp, group=self.group,
                                                          async_op=True))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   last: bool = False) -> torch.futures.Future[Any]:
        """Every rank's ``inp`` into the rows of ``out`` (world · inp.numel(),)."""
        # all_gather_single: torch 2.13's name for all_gather_into_tensor (one flat output);
        # gloo and NCCL both implement it.
        return self._issue("all_gather", inp.numel() * inp.element_size(), last,
                           lambda: dist.all_gather_single(out, inp, group=self.group,
                                                          async_op=True))

    def error(self, err_sq: torch.Tensor, ref_sq: torch.Tensor) -> None:
        """Add a stage's compression error (device tensors: no host sync)."""
        self.err_sq = err_sq if self.err_sq is None else self.err_sq + err_sq
        self.ref_sq = ref_sq if self.ref_sq is None else self.ref_sq + ref_sq

    def open_gate(self) -> None:
        """The next bucket may issue its collectives (idempotent)."""
        if not self._gate.done():
            self._gate.set_result(None)

    def _issue(self, op: str, nbytes: int, last: bool,
               launch: Callable[[], dist.Work | None]) -> torch.futures.Future[Any]:
        started = self._log.start()
        work = launch()
        assert work is not None
        if last:
            self.gate_ready = True
        self.sent_bytes += WIRE_BYTES[op](nbytes, self.world)
        self.calls += 1

        def stop(fut: torch.futures.Future[Any]) -> Any:
            self._log.stop(op, nbytes, started)  # here the collective is complete
            return fut.value()  # raises if it failed

        return work.get_future().then(stop)


class Compressor(ABC):
    """One compression method. ``send`` is a generator: it compresses the bucket, issues its
    collectives through the :class:`Channel`, yields the future of each one it must see
    finished before going on, and returns the averaged gradient, bucket-shaped. The hook runs
    it on the backend's callbacks, never blocking backward (the same path on gloo and NCCL).

    A compressor holds the state of its method (residuals, PowerSGD's Q) and nothing else;
    the hook owns timing, statistics and switching. It must not synchronise the host with the
    device: no ``.item()``, no waiting.
    """

    name: ClassVar[str]

    def __init__(self, cfg: CompressionConfig, group: dist.ProcessGroup | None, *,
                 step: int = 0) -> None:
        self.cfg = cfg
        self.group = group  # None: the default group, resolved when the first bucket comes
        self.step = step  # training steps completed before this compressor took over
        self._world: int | None = None
        self._rank: int | None = None

    @property
    def world(self) -> int:
        if self._world is None:  # lazily: a hook may be built before the group exists
            self._world = dist.get_world_size(self.group)
        return self._world

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank(self.group)
        return self._rank

    @abstractmethod
    def send(self, bucket: dist.GradBucket, ch: Channel) -> Steps:
        """Compress ``bucket.buffer()``, communicate through ``ch``; return the average."""

    def state_dict(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this method's state: error-feedback residuals by
        parameter name (``names``: id -> name)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor],  # noqa: B027
                        names: dict[int, str]) -> None:
        """Stateless methods have nothing to restore."""


class Residuals:
    """Error-feedback residuals, one per bucket index.

    DDP rebuilds its buckets once after the first iteration (in the order gradients became
    ready) and may again later, so an index can come to mean other parameters. Each residual
    is stored with the identity of the bucket's parameters and dropped when that changes:
    adding one layer's leftover gradient to another layer would be a silent bug.

    For checkpoints a residual is cut into one slice per parameter, named by the model's
    parameter names (``names``: id -> name): a resumed run's first buckets are laid out in
    another order than the saved ones, and names are what survives a restart.
    """

    def __init__(self) -> None:
        self._by_index: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._layout: dict[int, list[tuple[int, int]]] = {}  # index -> [(param id, numel)]
        self._restored: dict[str, torch.Tensor] = {}  # parameter name -> residual slice
        self._names: dict[int, str] = {}

    @staticmethod
    def _fingerprint(bucket: dist.GradBucket) -> tuple[int, ...]:
        return (bucket.buffer().numel(), *(id(p) for p in bucket.parameters()))

    def get(self, bucket: dist.GradBucket) -> torch.Tensor | None:
        held = self._by_index.get(bucket.index())
        if held is not None and held[0] == self._fingerprint(bucket):
            return held[1]
        return self._adopt(bucket)

    def put(self, bucket: dist.GradBucket, residual: torch.Tensor) -> None:
        self._by_index[bucket.index()] = (self._fingerprint(bucket), residual)
        self._layout[bucket.index()] = [(id(p), p.numel()) for p in bucket.parameters()]

    def __len__(self) -> int:
        return len(self._by_index)

    def norms(self) -> dict[int, float]:
        """Residual L2 norm per bucket index (host sync: for tests and debugging only)."""
        return {i: float(r.norm()) for i, (_, r) in self._by_index.items()}

    def state_dict(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for index, (_, residual) in self._by_index.items():
            offset = 0
            for pid, numel in self._layout[index]:
                out[names[pid]] = residual[offset:offset + numel].detach().cpu().clone()
                offset += numel
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], names: dict[int, str]) -> None:
        self._by_index.clear()
        self._restored, self._names = dict(state), names

    def _adopt(self, bucket: dist.GradBucket) -> torch.Tensor | None:
        """The restored slices of this bucket's parameters, in this bucket's layout."""
        if not self._restored:
            return None
        parts = [self._restored.get(self._names.get(id(p), "")) for p in bucket.parameters()]
        if any(part is None for part in parts) or sum(
                part.numel() for part in parts if part is not None) != bucket.buffer().numel():
            return None
        residual = torch.cat([p for p in parts if p is not None]).to(bucket.buffer().device)
        for p in bucket.parameters():
            self._restored.pop(self._names[id(p)], None)
        self.put(bucket, residual)
        return residual
