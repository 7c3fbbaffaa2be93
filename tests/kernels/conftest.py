"""Triton kernels on the CPU: the interpreter, fresh seeds, poisoned outputs, per-dtype bounds.

TRITON_INTERPRET=1 is set here, before any kernel module is imported: ``@triton.jit`` reads it
when the decorator runs. Kernel modules that something imported earlier (without the variable)
are dropped, so the next launch imports them again as interpreter functions.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
for _name in [m for m in sys.modules if m.startswith("traind.kernels._") and
              m.endswith("_triton")]:
    del sys.modules[_name]

from tests.conftest import IN_CI  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator

# Relative error bounds per dtype, as the issue states them: fp32 rounding differs only by
# summation order; bf16 keeps 8 bits of mantissa.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def require_triton() -> None:
    """Skip with the reason when triton is missing; in CI a missing triton fails the run."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        msg = f"triton is not importable ({exc}); pip install -e '.[test]'"
        if IN_CI:
            pytest.fail(f"CI=true and {msg}")
        pytest.skip(msg)


@pytest.fixture(autouse=True)
def _triton_and_seed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every kernel test: triton present, and a fresh seed, printed so a failure replays."""
    if getattr(request.module, "NEEDS_TRITON", True):
        require_triton()
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    yield


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with values no kernel writes (NaN, or the minimum of an int type) so an
    element the kernel skipped shows up as a mismatch."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL[dtype],
                               atol=ATOL[dtype])


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from traind.kernels import _dispatch

    def poisoned(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return poison(torch.empty(shape, dtype=dtype, device=device))

    monkeypatch.setattr(_dispatch, "new_output", poisoned)
