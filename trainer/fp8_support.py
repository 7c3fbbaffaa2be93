"""Whether fp8 training can run here: the rule and torchao's presence, without torch.

Apart from trainer/precision.py (which applies fp8) because the daemon asks too (the tuner's
hardware, daemon/autotune/runner.py) and must not import torch to ask: this module imports
neither torch nor torchao until :func:`torchao_available` is called.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from traind.extras import available, install_hint

if TYPE_CHECKING:
    from collections.abc import Iterator


def fp8_unsupported_reason(cuda_available: bool, capability: tuple[int, int] | None,
                           torchao_available: bool) -> str | None:
    """Why fp8 training cannot run here, or None when it can.

    ``cuda_available``: the job's device is a CUDA GPU. fp8 tensor cores arrived with compute
    capability 8.9 (Ada) and 9.0 (Hopper); torchao's Float8Linear is what drives them. Off
    CUDA, torchao emulates the fp8 matmuls (casts to fp8 and back, then an fp32 matmul): the
    same numerics, no speed, for tests and CPU-only nodes (:func:`fp8_emulated`).
    """
    if not torchao_available:
        return ("precision.mode: fp8 needs torchao (torchao's float8 training): "
                f"{install_hint('torchao')}")
    if not cuda_available or (capability is not None and capability >= (8, 9)):
        return None
    cc = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
    return ("precision.mode: fp8 needs an NVIDIA GPU with compute capability 8.9+ "
            f"(Ada/Hopper) for its fp8 tensor cores; this GPU has compute capability {cc}")


def fp8_emulated(device_type: str) -> bool:
    """fp8 runs in torchao's emulation: anywhere but CUDA (there are no fp8 kernels)."""
    return device_type != "cuda"


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """torchao's import logs a warning for each CUDA extension it cannot load (all of them on
    a CPU build of torch) and torch one for its deprecated Enum registration: noise on every
    run that says nothing about this one. Raised to ERROR for the import only."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_available() -> bool:
    """torchao's float8 training can be imported (finding it imports torchao itself)."""
    with quiet_torchao_import():
        return available("torchao.float8")
