"""kernels/swa.py: sliding-window attention with global tokens, forward and backward."""

from __future__ import annotations

import pytest
import torch

from traind.kernels import _dispatch, swa
from traind.trainer.attention import mask_matrix, naive_attention, sdpa_mask_attention

# (B, nh, T, hs, window, global_tokens); tiles are 16 under the interpreter, so T is never a
# multiple of them; hs=24 is no power of two; the window is a single token, or covers T.
CASES = [
    (1, 2, 75, 32, 20, 3),
    (2, 1, 50, 24, 7, 0),
    (1, 1, 40, 16, 1, 5),
    (1, 1, 33, 16, 64, 2),
    (1, 1, 70, 16, 9, 20),  # global columns span two tiles past the window's start
]

# max |kernel - oracle| / max |oracle|: fp32 differs by summation order only; bf16 operands
# (and p rounded to bf16 before P·V) put the error near bf16's 2^-8 relative step.
REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_match_oracle(case: tuple[int, ...], dtype: torch.dtype) -> None:
    B, H, T, hs, window, n_global = case
    q, k, v = (torch.randn(B, H, T, hs).to(dtype).requires_grad_() for _ in range(3))
    out, lse = swa.swa_forward_op(q, k, v, window, n_global)
    assert out.dtype == dtype and lse.shape == (B, H, T)
    # the oracle: the twin in fp32 on the same (rounded) inputs
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = swa.swa_torch(qf, kf, vf, window, n_global)
    assert _rel_err(out, ref) < REL[dtype]
    mask = mask_matrix(T, window, n_global)
    scores = (qf @ kf.transpose(-2, -1)).detach() * hs**-0.5
    ref_lse = scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=REL[dtype] * 10)
    dout = torch.randn(B, H, T, hs).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert _rel_err(g, rg) < REL[dtype] * 2, name  # two matmuls more than the forward


def test_twin_is_the_trainers_sdpa_path_bit_for_bit() -> None:
    q, k, v = (torch.randn(2, 2, 45, 16) for _ in range(3))
    mine = swa.swa_torch(q, k, v, 10, 4)
    assert torch.equal(mine, sdpa_mask_attention(q, k, v, window=10, global_tokens=4))
    torch.testing.assert_close(mine, naive_attention(q, k, v, mask_matrix(45, 10, 4)))


def test_opcheck_with_autograd() -> None:
    q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(swa.swa_forward_op, (q, k, v, 8, 2))
    o, lse = swa.swa_forward_op(q.detach(), k.detach(), v.detach(), 8, 2)
    torch.library.opcheck(swa.swa_backward_op,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, 8, 2))


def test_dispatch_runs_the_twin_on_cpu_and_triton_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (torch.randn(1, 1, 20, 16) for _ in range(3))
    mod = _dispatch.triton_module("_swa_triton")
    ran: list[str] = []
    kernel, twin = mod.forward, swa.swa_torch
    monkeypatch.setattr(mod, "forward", lambda *a: ran.append("triton") or kernel(*a))
    monkeypatch.setattr(swa, "swa_torch", lambda *a: ran.append("torch") or twin(*a))
    swa.sliding_window_attention(q, k, v, window=4, global_tokens=1)
    assert ran == ["torch"]
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    swa.sliding_window_attention(q, k, v, window=4, global_tokens=1)
    assert ran == ["torch", "triton"]
