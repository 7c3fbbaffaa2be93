"""Process-group setup from torchrun's environment, and the few collectives the loop needs.

torchrun (torch.distributed.elastic) sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; with no
such variables this is a single process and no process group is created, so the same loop runs
under ``traind run`` in the foreground, under pytest, and as one of N ranks.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it


def pick_device(pref: str, local_rank: int, cuda: Any = None) -> torch.device:
    """``job.device``: 'auto' takes CUDA when present; rank ``i`` on a node uses GPU ``i``.
    ``cuda``: ``torch.cuda`` (default) or a stand-in (tests: the GPU lines run on the CPU)."""
    cuda = cuda or torch.cuda
    if pref == "cuda" and not cuda.is_available():
        raise ValueError("job.device is 'cuda' but no CUDA device is available")
    if pref == "cpu" or not cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % cuda.device_count())


def backend(device: torch.device) -> str:
    """The process group's backend for ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def setup(device_pref: str, *, single_rank_group: bool = False, cuda: Any = None
          ) -> DistInfo:
    """Join the process group when torchrun says there is more than one rank, or when
    ``single_rank_group`` asks for one with a single rank (``parallel.single_rank_group``).
    ``cuda``: ``torch.cuda`` (default) or a stand-in (tests)."""
    cuda = cuda or torch.cuda
    if dist.is_available() and dist.is_initialized():  # a caller (a test) already set it up
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = pick_device(device_pref, local, cuda)
        if device.type == "cuda":
            cuda.set_device(device)
        return DistInfo(rank, local, world, device, owns_group=False)
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(device_pref, local, cuda)
    if device.type == "cuda":
        cuda.set_device(device)
    owns = False
    if world > 1 or single_rank_group:
        if "MASTER_ADDR" in os.environ:  # torchrun's rendezvous
            dist.init_process_group(backend=backend(device))
        else:  # one rank outside torchrun (a test, a script): a store of its own
            dist.init_process_group(backend=backend(device), rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{_free_port()}")
        owns = True
    return DistInfo(rank, local, world, device, owns_group=owns)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TEARDOWN_SECONDS = 30.0


def teardown(info: DistInfo) -> None:
    """Leave the process group, but never wait on it for long: the run's work is done and
    saved, and a backend that hangs in its shutdown must not keep the job from ending."""
    if not (info.owns_group and dist.is_initialized()):
        return
    done = threading.Thread(target=dist.destroy_process_group, name="traind-teardown",
                            daemon=True)
    done.start()
    done.join(TEARDOWN_SECONDS)
    if done.is_alive():
        print(f"rank {info.rank}: process group teardown still running after "
              f"{TEARDOWN_SECONDS:.0f} s; leaving without it", file=sys.stderr, flush=True)


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when ``flag`` is true on any: ranks must agree to leave the loop
    together, or the ones still stepping would wait forever in the next all-reduce."""
    return any_ranks((flag,), info)[0]


def any_ranks(flags: tuple[bool, ...], info: DistInfo) -> tuple[bool, ...]:
    """Each of ``flags`` true on every rank when true on any: several decisions agreed in one
    all-reduce."""
    if info.world_size == 1:
        return flags
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def all_gather(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; for small things like RNG states)."""
    if info.world_size == 1:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def mean(values: torch.Tensor, info: DistInfo) -> list[float]:
    """The element-wise mean of a small 1-d tensor over ranks, on the host (NaN and Inf
    propagate): every rank gets the same numbers, so decisions made on them agree."""
    if info.world_size > 1:
        values = values.detach().clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= info.world_size
    return [float(v) for v in values.tolist()]
