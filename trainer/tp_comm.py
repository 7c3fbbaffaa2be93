"""Tensor parallel's collectives, counted where DTensor issues them: at the dispatcher.

DTensor redistributes through the functional collectives (``torch.ops._c10d_functional``:
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ...), which return at
once and are completed by a later ``wait_tensor`` on their output. A ``TorchDispatchMode`` sees
both, so each collective's interval is stamped from its issue to its wait on the clock of
trainer/collectives.py (host ``perf_counter`` on CPU, CUDA events on GPUs: the wait makes the
current stream wait for the collective, so the end event marks its completion), and binned
into the same per-(op, size) window as the DDP hook's, by the mesh dimension of its group.
DTensor's own ``CommDebugMode`` would count them too, but its module tracker raised
IndexError inside this model's forward hooks (torch 2.13).

Why only every ``telemetry.layer_every`` steps (and the last): a Python dispatch mode sees
every aten op of the forward and backward, not only the collectives, and that costs time on
every op. Measured by bench/tp_count.py (two gloo ranks, tp2, 2 layers, batch 4 x 32
tokens, one thread each, forward and backward, medians of 40 paired steps) on this shared
two-core machine: +3% to +31% of a counted step over six runs at d_model 32 and 256 (the
load moved it more than the width did). Too much for every step (``telemetry.every`` is 1 by
default); once in ``layer_every`` (10) steps it is a few percent at most.

The collectives of a step are a fixed function of the model and the batch shape, so the
counted step's set, times the steps since the last count, is exact in calls and bytes and an
estimate in seconds (:func:`scale_window`). Under ``job.compile`` nothing is counted (the
loop's ``_tp_comm`` says why).

A collective's result is usually waited on inside the dispatch of the op that first reads it
(``AsyncCollectiveTensor``), where this mode does not see the ``wait_tensor``: the mode waits
on such an argument itself first, as the op would have, and stamps the end there.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode

from traind.trainer.collectives import CollectiveLog

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch.distributed.device_mesh import DeviceMesh

    from traind.trainer.collectives import Clock

# functional collective -> the op name of traind's per-collective families (the nccl-tests
# factors of metrics/arithmetic.py know these); the coalesced forms count as their op
OPS = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
       "reduce_scatter_tensor": "reduce_scatter",
       "reduce_scatter_tensor_coalesced": "reduce_scatter",
       "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
       "all_to_all_single": "all_to_all"}


def message_bytes(arg: Any) -> int:
    """The bytes a rank hands a collective: its input tensor's, or its list's (coalesced)."""
    if isinstance(arg, (list, tuple)):
        return sum(message_bytes(a) for a in arg)
    return int(arg.numel() * arg.element_size())


def _address(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


def scale_window(collectives: list[dict[str, Any]], factor: int) -> list[dict[str, Any]]:
    """A window's per-(op, size) dicts as if each of its steps had repeated ``factor`` times."""
    return [{**c, "calls": c["calls"] * factor, "bytes": c["bytes"] * factor,
             "seconds": c["seconds"] * factor, "counts": [n * factor for n in c["counts"]]}
            for c in collectives]


def _pending(args: Any, kwargs: dict[str, Any]) -> Iterator[AsyncCollectiveTensor]:
    """The not yet waited collective results among an op's arguments (and in its lists)."""
    for a in (*args, *kwargs.values()):
        for x in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(x, AsyncCollectiveTensor) and not x.completed:
                yield x


class _Counting(TorchDispatchMode):
    def __init__(self, owner: MeshCollectives) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != "_c10d_functional":
            if not func.is_view:
                # An op on a collective's pending result waits for it inside the result's
                # own dispatch (AsyncCollectiveTensor), where this mode does not see the
                # wait_tensor: wait here first, as it would, and stamp the end.
                for pending in _pending(args, kwargs):
                    pending.trigger_wait()
                    self.owner.waited(pending.elem)
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        owner = self.owner
        if name == "wait_tensor":
            out = func(*args, **kwargs)
            owner.waited(args[0])
            return out
        op = OPS.get(name)
        group = kwargs.get("group_name", args[-1] if args else None)
        log = owner.logs.get(owner.dims.get(group, ""))
        if op is None or log is None:  # not a collective we count, or another group's
            return func(*args, **kwargs)
        started = log.start()
        out = func(*args, **kwargs)
        owner.issued(out, (log, op, message_bytes(args[0]), started))
        return out


class MeshCollectives:
    """The functional collectives of the steps run inside :meth:`recording`, per mesh
    dimension (``dims``: a process group's name -> its dimension); :meth:`take` reads them."""

    def __init__(self, dims: dict[str, str], clock: Clock,
                 sizes: dict[str, int] | None = None) -> None:
        self.dims = dims
        self.sizes = sizes or {}  # a dimension's group size (the bus-bandwidth factors)
        self.counted_at = 0  # the step of the last count (the loop's, for the scaling)
        self.logs = {dim: CollectiveLog(clock) for dim in sorted(set(dims.values()))}
        # an issued collective's output (by its storage's address: a wait on a view of it
        # finds it) -> its log, op, bytes and start
        self._open: dict[int, tuple[CollectiveLog, str, int, Any]] = {}

    @classmethod
    def for_mesh(cls, mesh: DeviceMesh, clock: Clock, dims: tuple[str, ...] = ("tp",)
                 ) -> MeshCollectives:
        """Counting the collectives on ``mesh``'s groups of ``dims``."""
        return cls({mesh.get_group(d).group_name: d for d in dims}, clock,
                   {d: mesh[d].size() for d in dims})

    def issued(self, out: Any, entry: tuple[CollectiveLog, str, int, Any]) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            # an output freed unwaited leaves its entry open; a new output at its address
            # closes it, counted up to now (never seen on this model, kept as a bound)
            if (stale := self._open.get(_address(t))) is not None:
                self._close(stale)
            self._open[_address(t)] = entry

    def _close(self, entry: tuple[CollectiveLog, str, int, Any]) -> None:
        log, op, nbytes, started = entry
        # a coalesced call's outputs share one entry: the first wait closes it
        for key in [k for k, e in self._open.items() if e is entry]:
            del self._open[key]
        log.stop(op, nbytes, started)

    def waited(self, tensor: Any) -> None:
        entry = self._open.get(_address(tensor))
        if entry is not None:
            self._close(entry)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count the collectives issued inside (forward and backward of one step)."""
        try:
            with _Counting(self):
                yield
        finally:
            for entry in {id(e): e for e in self._open.values()}.values():  # never waited on
                self._close(entry)

    def take(self, factor: int = 1) -> dict[str, tuple[list[dict[str, Any]], float]]:
        """Per dimension, the window since the last call (trainer/collectives.py's
        ``take_window``: per-(op, size) dicts and the busy seconds), scaled by ``factor``
        steps (:func:`scale_window`)."""
        out = {}
        for dim, log in self.logs.items():
            window, busy = log.take_window()
            out[dim] = (scale_window(window, factor), busy * factor)
        return out
