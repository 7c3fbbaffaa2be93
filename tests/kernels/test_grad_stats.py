"""kernels/grad_stats.py: the fused Welford update with per-group sums, one launch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernels.conftest import RTOL
from traind.kernels import _dispatch, grad_stats
from traind.trainer.precision import SNRTracker

# tensor sizes around the 2048-element chunk: smaller, larger and not a multiple of it
SIZES = [(3, 5), (2049,), (700, 7), (1,)]
GROUPS = [0, 0, 1, 2]  # group of each tensor


def _state(dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], ...]:
    grads = [torch.randn(s).to(dtype).float() for s in SIZES]
    mean = [torch.randn(s) * 0.1 for s in SIZES]
    m2 = [torch.rand(s) for s in SIZES]
    return grads, mean, m2


def _triton():
    return _dispatch.triton_module("_grad_stats_triton")


@pytest.mark.parametrize("count", [1, 2, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_and_sums_match_twin(count: int, dtype: torch.dtype) -> None:
    grads, mean, m2 = _state(dtype)
    group_of = torch.tensor(GROUPS)
    t_mean, t_m2 = [t.clone() for t in mean], [t.clone() for t in m2]
    sums = _triton().welford_update(grads, mean, m2, count, group_of, 3)
    t_sums = grad_stats.welford_update_torch(grads, t_mean, t_m2, count, group_of, 3)
    # the gradients arrive as float32 (the tracker casts), so fp32 bounds hold for both dtypes
    for a, b in zip(mean + m2, t_mean + t_m2, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL[torch.float32], atol=1e-6)
    torch.testing.assert_close(sums, t_sums, rtol=RTOL[torch.float32], atol=1e-6)


def test_twin_is_the_trackers_code() -> None:
    params = [nn.Parameter(torch.zeros(s)) for s in SIZES]
    tracker = SNRTracker({"a": params[:2], "b": params[2:3], "c": params[3:]})
    mean, m2 = [torch.zeros(s) for s in SIZES], [torch.zeros(s) for s in SIZES]
    for step in range(1, 4):
        grads = [torch.randn(s) for s in SIZES]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        tracker.record()
        sums = grad_stats.welford_update_torch(grads, mean, m2, step, torch.tensor(GROUPS), 3)
    for a, b in zip(mean + m2, tracker._mean + tracker._m2, strict=True):
        assert torch.equal(a, b)
    snr = tracker.snr()
    signal, noise = sums[0].tolist(), (sums[1] / 2).tolist()  # as snr(): fp32, then floats
    expected = [a * 3 / b for a, b in zip(signal, noise, strict=True)]  # 3 steps' mean
    assert list(snr.values()) == expected


def test_opcheck() -> None:
    grads, mean, m2 = _state()
    torch.library.opcheck(grad_stats.welford_update_op,
                          (grads, mean, m2, 3, torch.tensor(GROUPS), 3))


def test_dispatch_runs_the_twin_on_cpu_and_triton_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    grads, mean, m2 = _state()
    group_of = torch.tensor(GROUPS)
    ran: list[str] = []
    kernel, twin = _triton().welford_update, grad_stats.welford_update_torch
    monkeypatch.setattr(_triton(), "welford_update",
                        lambda *a: ran.append("triton") or kernel(*a))
    monkeypatch.setattr(grad_stats, "welford_update_torch",
                        lambda *a: ran.append("torch") or twin(*a))
    grad_stats.welford_update(grads, mean, m2, 1, group_of, 3)
    assert ran == ["torch"]
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    grad_stats.welford_update(grads, mean, m2, 2, group_of, 3)
    assert ran == ["torch", "triton"]


def test_tracker_takes_the_kernel_path_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """SNRTracker on "CUDA" (forced here, the interpreter runs the kernel) agrees with itself
    on the CPU path."""
    params = [nn.Parameter(torch.zeros(s)) for s in SIZES]
    groups = {"a": params[:2], "b": params[2:3], "c": params[3:]}
    cpu, fused = SNRTracker(groups), SNRTracker(groups)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn_like(p) + 0.3
        cpu.record()
        monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
        fused.record()
        monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)
    assert fused._sums is not None
    for name, value in fused.snr().items():
        assert value == pytest.approx(cpu.snr()[name], rel=1e-5)
