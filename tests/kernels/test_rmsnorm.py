"""kernels/rmsnorm.py: fused RMSNorm forward and backward against F.rms_norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernels.conftest import assert_close
from traind.kernels import _dispatch, rmsnorm

SHAPES = [(3, 5, 48), (7, 33), (1, 100)]  # D=48, 33, 100: none a power of two


def _triton():
    return _dispatch.triton_module("_rmsnorm_triton")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_match_twin(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    D = shape[-1]
    x = (torch.randn(shape) * 3 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(D) + 0.5).requires_grad_()
    eps = torch.finfo(dtype).eps
    y, rstd = rmsnorm.rms_norm_op(x, w, eps)
    y_ref = rmsnorm.rms_norm_torch(x.float(), w, eps)  # the oracle in fp32
    assert y.dtype == dtype and rstd.shape == shape[:-1]
    assert_close(y, y_ref, dtype)
    dy = torch.randn(shape).to(dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy.float())
    assert dx.dtype == dtype and dw.dtype == torch.float32
    assert_close(dx, dx_ref, dtype)
    assert_close(dw, dw_ref, dtype)


def test_fp32_twin_is_what_nn_rmsnorm_computes() -> None:
    x = torch.randn(4, 9, 40)
    norm = nn.RMSNorm(40)
    norm.weight.data.uniform_(0.5, 1.5)
    mine = rmsnorm.RMSNorm(40)
    mine.load_state_dict(norm.state_dict())
    assert torch.equal(mine(x), norm(x))  # CPU: the module runs the twin, bit for bit
    assert torch.equal(rmsnorm.rms_norm(x, norm.weight, torch.finfo(x.dtype).eps), norm(x))


def test_opcheck_with_autograd() -> None:
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.rand(40, requires_grad=True)
    torch.library.opcheck(rmsnorm.rms_norm_op, (x, w, 1e-6))
    _, rstd = rmsnorm.rms_norm_op(x.detach(), w.detach(), 1e-6)
    torch.library.opcheck(rmsnorm.rms_norm_backward_op,
                          (torch.randn(6, 40), x.detach(), w.detach(), rstd))


def test_dispatch_runs_the_twin_on_cpu_and_triton_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 40)
    norm = rmsnorm.RMSNorm(40)
    ran: list[str] = []
    kernel, twin = _triton().forward, rmsnorm.rms_norm_torch
    monkeypatch.setattr(_triton(), "forward", lambda *a: ran.append("triton") or kernel(*a))
    monkeypatch.setattr(rmsnorm, "rms_norm_torch", lambda *a: ran.append("torch") or twin(*a))
    monkeypatch.setattr(nn.RMSNorm, "forward", lambda self, t: ran.append("torch") or t)
    norm(x)
    rmsnorm.rms_norm(x, norm.weight, 1e-6)
    assert ran == ["torch", "torch"]
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    norm(x)
    rmsnorm.rms_norm(x, norm.weight, 1e-6)
    assert ran == ["torch", "torch", "triton", "triton"]
