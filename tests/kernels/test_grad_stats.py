"""kernels/grad_stats.py: per-group squared gradient norms in one launch, against its twin."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.kernels.conftest import RTOL
from traind.kernels import _dispatch, grad_stats
from traind.trainer.precision import SNRTracker

# tensor sizes around the 2048-element chunk: smaller, larger and not a multiple of it
SIZES = [(3, 5), (2049,), (700, 7), (1,), (4096,)]
GROUPS = [0, 0, 1, 2, 1]  # group of each tensor


def _grads(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [(torch.randn(s) * (i + 1)).to(dtype) for i, s in enumerate(SIZES)]


def _triton():
    return _dispatch.triton_module("_grad_stats_triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin_and_a_direct_sum(dtype: torch.dtype) -> None:
    grads = _grads(dtype)
    group_of = torch.tensor(GROUPS)
    got = _triton().group_sq_norms(grads, group_of, 4)
    twin = grad_stats.group_sq_norms_torch(grads, group_of, 4)
    direct = torch.zeros(4, dtype=torch.float64)
    for g, k in zip(grads, GROUPS, strict=True):
        direct[k] += g.double().square().sum()
    # bf16 gradients are read as they are and summed in fp32 by both: fp32 bounds for both
    torch.testing.assert_close(got, twin, rtol=RTOL[torch.float32], atol=1e-6)
    torch.testing.assert_close(got.double(), direct, rtol=RTOL[torch.float32], atol=1e-6)
    assert got[3] == 0  # a group without tensors


def test_empty_inputs() -> None:
    empty = torch.tensor([], dtype=torch.long)
    assert torch.equal(_triton().group_sq_norms([], empty, 2), torch.zeros(2))
    assert torch.equal(grad_stats.group_sq_norms_torch([], empty, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="one entry per tensor"):
        grad_stats.group_sq_norms(_grads(), torch.tensor([0]), 1)


def test_opcheck() -> None:
    torch.library.opcheck(grad_stats.group_sq_norms_op, (_grads(), torch.tensor(GROUPS), 3))


def test_dispatch_runs_the_twin_on_cpu_and_triton_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    grads, group_of = _grads(), torch.tensor(GROUPS)
    ran: list[str] = []
    kernel, twin = _triton().group_sq_norms, grad_stats.group_sq_norms_torch
    monkeypatch.setattr(_triton(), "group_sq_norms", lambda *a: ran.append("triton") or kernel(*a))
    monkeypatch.setattr(grad_stats, "group_sq_norms_torch",
                        lambda *a: ran.append("torch") or twin(*a))
    grad_stats.group_sq_norms(grads, group_of, 3)
    assert ran == ["torch"]
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    grad_stats.group_sq_norms(grads, group_of, 3)
    assert ran == ["torch", "triton"]


def test_tracker_takes_the_kernel_path_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """SNRTracker on "CUDA" (forced here, the interpreter runs the kernel) agrees with itself
    on the CPU path, a parameter without a gradient included."""
    params = [nn.Parameter(torch.zeros(s)) for s in SIZES]
    groups = {"a": params[:2], "b": params[2:3], "c": params[3:]}
    cpu, fused = SNRTracker(groups, 8), SNRTracker(groups, 8)
    for step in range(6):
        for i, p in enumerate(params):
            p.grad = None if (i, step) == (1, 2) else torch.randn_like(p) * (1 + step % 3)
        cpu.record()
        monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
        fused.record()
        monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)
    torch.testing.assert_close(fused._rows, cpu._rows, rtol=RTOL[torch.float32], atol=1e-6)
    for name, value in fused.snr().items():
        assert math.isfinite(value) and value == pytest.approx(cpu.snr()[name], rel=1e-5)
