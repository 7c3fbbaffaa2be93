"""kernels/swa.py: sliding-window attention with global tokens, forward and backward."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from tests.conftest import REPO
from traind.kernels import _dispatch, swa
from traind.trainer.attention import mask_matrix, naive_attention, sdpa_mask_attention

if TYPE_CHECKING:
    from collections.abc import Iterator

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
# TF32 keeps 10 bits of mantissa: operands rounded to a relative 2^-11 ~ 5e-4, and the errors
# of a few roundings add up in the softmax and the backward's extra matmuls.
REL_TF32 = 4e-3


def _round_to_tf32(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to nearest-even TF32 (the low 13 of 23 mantissa bits dropped)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return u.view(np.float32)


@pytest.fixture
def dots(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The input precision of every ``tl.dot`` the interpreter runs, which also does what a
    GPU does for "tf32" (the interpreter alone computes every dot in full fp32): it rounds
    fp32 operands to TF32 first, so a tf32 kernel's error is a GPU's."""
    from triton.runtime import interpreter

    seen: list[str] = []
    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: object, a: object, b: object, d: object, precision: object,
                   max_imprecise: object) -> object:
        seen.append(str(precision).rsplit(".", 1)[-1].lower())  # "INPUT_PRECISION.TF32"
        if seen[-1] == "tf32" and a.data.dtype == np.float32:  # type: ignore[attr-defined]
            a = interpreter.TensorHandle(_round_to_tf32(a.data), a.dtype)  # type: ignore[attr-defined]
            b = interpreter.TensorHandle(_round_to_tf32(b.data), b.dtype)  # type: ignore[attr-defined]
        return real(self, a, b, d, precision, max_imprecise)  # type: ignore[arg-type]

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield seen


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("dtype", "precision"), [(torch.float32, "ieee"),
                                                  (torch.float32, "tf32"),
                                                  (torch.bfloat16, "ieee")])
def test_forward_and_backward_match_oracle(case: tuple[int, ...], dtype: torch.dtype,
                                           precision: str, dots: list[str]) -> None:
    B, H, T, hs, window, n_global = case
    rel = REL_TF32 if precision == "tf32" else REL[dtype]
    q, k, v = (torch.randn(B, H, T, hs).to(dtype).requires_grad_() for _ in range(3))
    out, lse = swa.swa_forward_op(q, k, v, window, n_global, precision)
    assert out.dtype == dtype and lse.shape == (B, H, T)
    # the oracle: the twin in fp32 on the same (rounded) inputs
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = swa.swa_torch(qf, kf, vf, window, n_global)
    assert _rel_err(out, ref) < rel
    mask = mask_matrix(T, window, n_global)
    scores = (qf @ kf.transpose(-2, -1)).detach() * hs**-0.5
    ref_lse = scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=rel * 10)
    dout = torch.randn(B, H, T, hs).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert _rel_err(g, rg) < rel * 2, name  # two matmuls more than the forward
    # every dot of the forward and of both backward kernels ran at the precision asked for
    assert dots and set(dots) == {precision}


def test_tf32_is_really_coarser_than_ieee(dots: list[str]) -> None:
    """The tf32 variant rounds (on a GPU, and under the emulating ``dots``), the ieee one
    does not: a kernel that ignored PRECISION would pass the tolerance test above."""
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    ref = swa.swa_torch(q, k, v, 16, 2)
    ieee, _ = swa.swa_forward_op(q, k, v, 16, 2, "ieee")
    tf32, _ = swa.swa_forward_op(q, k, v, 16, 2, "tf32")
    assert _rel_err(ieee, ref) < 1e-5 < _rel_err(tf32, ref) < REL_TF32


@pytest.mark.parametrize(
    ("dtype", "setting", "expected"),
    [
        (torch.float32, "tf32", "tf32"),  # fp32 with TF32 allowed: the tensor-core path
        (torch.float32, "ieee", "ieee"),
        (torch.float32, "none", "ieee"),  # torch's default: nothing set, no TF32
        (torch.bfloat16, "tf32", "ieee"),  # TF32 is about fp32 operands only
        (torch.float16, "tf32", "ieee"),
        (torch.bfloat16, "ieee", "ieee"),
    ],
)
def test_dot_precision_table(dtype: torch.dtype, setting: str, expected: str) -> None:
    assert swa.dot_precision(dtype, setting) == expected


# Every way a user may allow (and forbid) TF32, applied in turn, each followed by what the
# kernel must then use. In a child process: once torch's legacy and new APIs have both set it,
# reading the legacy flag raises, and that state must not leak into the other tests.
TF32_SETTINGS = [
    ("pass", "ieee"),  # torch's default
    ("torch.backends.cuda.matmul.allow_tf32 = True", "tf32"),  # the legacy flag (loop.py's)
    ("torch.backends.cuda.matmul.allow_tf32 = False", "ieee"),
    ("torch.set_float32_matmul_precision('high')", "tf32"),
    ("torch.set_float32_matmul_precision('medium')", "tf32"),
    ("torch.set_float32_matmul_precision('highest')", "ieee"),
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),  # the new API
    ("torch.backends.cuda.matmul.fp32_precision = 'none'", "ieee"),
    ("torch.backends.fp32_precision = 'tf32'", "tf32"),  # the new global, inherited
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),  # ... overridden
]


def test_every_tf32_setting_is_read() -> None:
    script = "import torch\nfrom traind.kernels import swa\n" + "".join(
        f"{line}\nprint(swa.dot_precision(torch.float32, swa.cuda_fp32_matmul_precision()))\n"
        for line, _ in TF32_SETTINGS)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = proc.stdout.split()
    assert list(zip([line for line, _ in TF32_SETTINGS], got, strict=True)) == [
        (line, expected) for line, expected in TF32_SETTINGS]


def test_dispatch_passes_the_setting_and_backward_keeps_the_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _dispatch.triton_module("_swa_triton")
    asked: list[tuple[str, str]] = []
    fwd, bwd = mod.forward, mod.backward
    monkeypatch.setattr(mod, "forward", lambda *a: asked.append(("fwd", a[-1])) or fwd(*a))
    monkeypatch.setattr(mod, "backward", lambda *a: asked.append(("bwd", a[-1])) or bwd(*a))
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    setting = {"now": "ieee"}
    monkeypatch.setattr(swa, "cuda_fp32_matmul_precision", lambda: setting["now"])
    for dtype, now, expected in [(torch.float32, "ieee", "ieee"),
                                 (torch.float32, "tf32", "tf32"),
                                 (torch.bfloat16, "tf32", "ieee")]:
        setting["now"] = now
        q, k, v = (torch.randn(1, 1, 20, 16).to(dtype).requires_grad_() for _ in range(3))
        out = swa.sliding_window_attention(q, k, v, window=4, global_tokens=1)
        setting["now"] = "ieee" if now == "tf32" else "tf32"  # flipped between fwd and bwd
        out.float().sum().backward()
        assert asked == [("fwd", expected), ("bwd", expected)], (dtype, now)
        asked.clear()


def test_twin_is_the_trainers_sdpa_path_bit_for_bit() -> None:
    q, k, v = (torch.randn(2, 2, 45, 16) for _ in range(3))
    mine = swa.swa_torch(q, k, v, 10, 4)
    assert torch.equal(mine, sdpa_mask_attention(q, k, v, window=10, global_tokens=4))
    torch.testing.assert_close(mine, naive_attention(q, k, v, mask_matrix(45, 10, 4)))


def test_opcheck_with_autograd() -> None:
    q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(swa.swa_forward_op, (q, k, v, 8, 2, "ieee"))
    o, lse = swa.swa_forward_op(q.detach(), k.detach(), v.detach(), 8, 2, "ieee")
    torch.library.opcheck(swa.swa_backward_op,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, 8, 2,
                           "ieee"))


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


def test_the_constant_mark_is_torchs() -> None:
    # swa marks its TF32 getter as dynamo does, without importing dynamo at start-up: the mark
    # must stay the one torch.compiler.assume_constant_result sets
    def probe() -> str:
        return ""

    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and vars(probe) == vars(swa.cuda_fp32_matmul_precision) != {}
