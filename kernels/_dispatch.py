"""Which implementation runs: the Triton kernel on CUDA tensors, the PyTorch twin elsewhere.

Triton kernels live in ``_*_triton.py`` modules that are imported only when a kernel first
runs. Two reasons: ``@triton.jit`` decides at decoration time whether it compiles for the GPU
or builds an interpreter function (``TRITON_INTERPRET=1``), so importing lazily lets the tests
set that variable first; and a CPU-only run never pays for importing triton at all.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

import torch

from traind.extras import available, missing_message

if TYPE_CHECKING:
    from types import ModuleType

HAS_TRITON = available("triton")
log = logging.getLogger(__name__)


def is_dtensor(t: torch.Tensor) -> bool:
    """``t`` is a DTensor (FSDP2's shards, tensor parallel's). Without importing DTensor's
    package, which adds 0.4 s to every job's start-up: a DTensor exists only once it is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for ``t``: only on CUDA, and only where triton is installed."""
    if not t.is_cuda:
        return False
    if is_dtensor(t):
        # Tensor parallel: DTensor shards ops by its rules for aten's ops (the twins); a
        # custom kernel has none, so a sharded activation takes the twin on CUDA too.
        return False
    if not HAS_TRITON:
        _say_twins_run()
    return HAS_TRITON


@functools.cache
def _say_twins_run() -> None:
    # Once per process: a GPU without triton trains correctly on the twins, only slower.
    log.warning("%s; the PyTorch twins run instead", missing_message("triton"))


def interpreting() -> bool:
    """Kernels run under triton's CPU interpreter (tests); read when a kernel launches."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_module(name: str) -> ModuleType:
    """The module holding a kernel's ``@triton.jit`` code (``_rmsnorm_triton`` ...).

    Looked up on every launch (a dict lookup once imported), so a test that drops the module
    from ``sys.modules`` gets it rebuilt under the interpreter.
    """
    return importlib.import_module(f"traind.kernels.{name}")


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for every tensor a kernel writes. The tests swap in one that fills it
    with NaN (or an integer type's minimum), so an element a kernel never wrote fails them."""
    return torch.empty(shape, dtype=dtype, device=device)
