"""The base class every compression method implements, and the per-bucket residual store."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.config import CompressionConfig


@dataclass(slots=True)
class Sent:
    """One bucket after ``Compressor.send``: compressed and in flight."""

    future: torch.futures.Future[Any]  # done when this bucket's collectives are
    finish: Callable[[], torch.Tensor]  # decompress: the averaged gradient, bucket-shaped
    sent_bytes: int  # what this rank puts on the wire for this bucket (ring algorithms)
    # ||x_hat - x||² and ||x||² of this rank's input x (None: lossless, nothing to add). A
    # method that only knows its error after the collective (PowerSGD) sets them in finish().
    err_sq: torch.Tensor | None = None
    ref_sq: torch.Tensor | None = None


class Compressor(ABC):
    """One compression method: ``send`` compresses a bucket and starts its collectives (the
    compress and communicate halves); the returned ``Sent.finish`` decompresses and averages.

    A compressor holds the state of its method (residuals, PowerSGD's Q) and nothing else;
    the hook owns timing, statistics and switching. It must not synchronise the host with the
    device: no ``.item()``, no waiting.
    """

    name: ClassVar[str]
    collective: ClassVar[str] = "all_reduce"  # the op its ``send`` starts, for per-op metrics

    def __init__(self, cfg: CompressionConfig, group: dist.ProcessGroup | None, *,
                 step: int = 0) -> None:
        self.cfg = cfg
        self.group = group  # None: the default group, resolved when the first bucket comes
        self.step = step  # training steps completed before this compressor took over
        self._world: int | None = None

    @property
    def world(self) -> int:
        if self._world is None:  # lazily: a hook may be built before the group exists
            self._world = dist.get_world_size(self.group)
        return self._world

    @abstractmethod
    def send(self, bucket: dist.GradBucket) -> Sent:
        """Compress ``bucket.buffer()`` and start the collective(s) on ``self.group``."""

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


def completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``value`` (for a collective-free path such as world size 1)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut
