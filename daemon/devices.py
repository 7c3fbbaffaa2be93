"""The GPUs this node has, read through NVML: the daemon never initialises CUDA.

The daemon forks workers (torchrun) and must not touch CUDA itself: ``torch.cuda``'s queries
load the driver in the daemon's process, and ``get_device_capability()`` creates a context
there, which a forked child cannot use (DESIGN: never fork after CUDA is initialised). NVML,
the library the GPU collector reads, answers what the daemon needs (how many GPUs, their
names, their compute capability) without either. The workers find their device themselves.

NVML lists every GPU of the host; ``CUDA_VISIBLE_DEVICES`` (indexes or UUIDs, as CUDA reads
it) narrows them to the ones the daemon's jobs can see, as ``torch.cuda.device_count()`` did.
A host without NVIDIA (no libnvidia-ml, no driver, no GPUs; a CPU-only torch build, which could
not use them anyway) has no GPU, and :attr:`Devices.reason` says why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pynvml

from traind.daemon.provenance import torch_build

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int  # NVML's (the host's), not the index inside CUDA_VISIBLE_DEVICES
    uuid: str
    name: str
    capability: tuple[int, int]  # CUDA compute capability (major, minor), e.g. (9, 0)


@dataclass(frozen=True, slots=True)
class Devices:
    """What the node has; ``gpus`` empty on a CPU node, with ``reason`` saying why."""

    gpus: tuple[Gpu, ...] = ()
    reason: str = ""

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def kind(self) -> str:
        """The device a job gets by default: ``"cuda"`` where there is a GPU, else ``"cpu"``."""
        return "cuda" if self.gpus else "cpu"

    @property
    def capability(self) -> tuple[int, int] | None:
        """The lowest compute capability among the GPUs (a job's ranks span them all)."""
        return min((g.capability for g in self.gpus), default=None)


def visible(gpus: Sequence[Gpu], spec: str | None) -> tuple[Gpu, ...]:
    """The GPUs ``CUDA_VISIBLE_DEVICES=spec`` leaves, in its order: unset, all of them; each
    entry an index or a UUID (a unique prefix will do); CUDA stops at the first entry that
    names no GPU, and so does this."""
    if spec is None:
        return tuple(gpus)
    out: list[Gpu] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit():
            found = [g for g in gpus if g.index == int(entry)]
        else:
            found = [g for g in gpus if entry and g.uuid.startswith(entry)]
        if len(found) != 1 or found[0] in out:
            break
        out.append(found[0])
    return tuple(out)


def read_devices(nvml: Any = None, *, cuda_build: bool | None = None,
                 env: Mapping[str, str] | None = None) -> Devices:
    """The node's GPUs from NVML, as ``CUDA_VISIBLE_DEVICES`` in ``env`` (default: this
    process's) leaves them. ``nvml``: the ``pynvml`` module (default) or a stand-in with its
    function names (tests); ``cuda_build``: whether torch was built with CUDA (default:
    ``torch.version.cuda``, read without importing torch: provenance.torch_build)."""
    if not (torch_build().cuda is not None if cuda_build is None else cuda_build):
        return Devices(reason="this torch build has no CUDA")
    api = pynvml if nvml is None else nvml
    try:
        api.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        return Devices(reason=f"no NVIDIA device: {e or type(e).__name__}")
    try:
        gpus = []
        for i in range(api.nvmlDeviceGetCount()):
            handle = api.nvmlDeviceGetHandleByIndex(i)
            major, minor = api.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(Gpu(i, _text(api.nvmlDeviceGetUUID(handle)),
                            _text(api.nvmlDeviceGetName(handle)), (int(major), int(minor))))
    except Exception as e:  # a lost GPU, a permission: say so, and run on the CPU
        log.warning("NVML opened but listing the GPUs failed: %s", e)
        return Devices(reason=f"listing the GPUs failed: {e}")
    finally:
        try:
            api.nvmlShutdown()  # NVML counts inits: the GPU collector's session stays open
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)
    shown = visible(gpus, (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"))
    if not shown:
        return Devices(reason="NVML reports 0 GPUs" if not gpus else
                       "CUDA_VISIBLE_DEVICES leaves none of the GPUs")
    return Devices(shown)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
