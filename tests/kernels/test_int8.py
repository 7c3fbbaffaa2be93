"""kernels/int8.py: the fused quantize-with-error-feedback and the dequantize-accumulate."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import RTOL, assert_close
from traind.kernels import _dispatch, int8
from traind.trainer.compression._math import (
    dequantize_int8,
    error_feedback,
    quantize_int8,
    squared_error,
)

# (n, block): none of the sizes a multiple of the block; a block that is no power of two; a
# bucket smaller than one block
CASES = [(1000, 256), (77, 32), (513, 100), (5, 64)]


def _triton():  # the launcher module, imported under the interpreter
    return _dispatch.triton_module("_int8_triton")


@pytest.mark.parametrize(("n", "block"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_quantize_ef_matches_twin(n: int, block: int, dtype: torch.dtype,
                                  with_residual: bool) -> None:
    g = torch.randn(n).to(dtype)
    r = torch.randn(n) * 0.01 if with_residual else None
    q, scales, res, err, ref = _triton().quantize_ef(g, r, block)
    tq, tscales, tres, terr, tref = int8.quantize_ef_torch(g, r, block)
    # The math is fp32 whatever g's dtype, so fp32 bounds apply; q may differ by one step
    # only where x/scale lands on a rounding tie, which fp32 division reproduces exactly.
    assert torch.equal(q, tq)
    assert_close(scales, tscales, torch.float32)
    assert_close(res, tres, torch.float32)
    torch.testing.assert_close(err, terr, rtol=RTOL[torch.float32], atol=1e-9)
    torch.testing.assert_close(ref, tref, rtol=RTOL[torch.float32], atol=1e-9)


@pytest.mark.parametrize(("n", "block"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_the_trainers_code_bit_for_bit(n: int, block: int, dtype: torch.dtype) -> None:
    g, r = torch.randn(n).to(dtype), torch.randn(n) * 0.01
    fb = error_feedback(g, r, lambda x: quantize_int8(x, block),
                        lambda p: dequantize_int8(p[0], p[1], block))
    err, ref = squared_error(fb.x, fb.x_hat)
    q, scales, res, terr, tref = int8.quantize_ef_torch(g, r, block)
    for mine, theirs in [(q, fb.payload[0]), (scales, fb.payload[1]), (res, fb.residual),
                         (terr, err), (tref, ref)]:
        assert torch.equal(mine, theirs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN, as intended
def test_non_finite_input_reaches_the_scale_and_not_the_residual() -> None:
    g = torch.randn(300)
    g[7], g[290] = float("nan"), float("inf")
    _, scales, res, _, _ = _triton().quantize_ef(g, None, 128)
    _, tscales, tres, _, _ = int8.quantize_ef_torch(g, None, 128)
    assert scales[0].isnan() and scales[2].isinf()  # the scaler still sees the overflow
    assert torch.equal(scales[1], tscales[1])
    assert torch.isfinite(res).all()
    assert torch.equal(res[128:256], tres[128:256])


def _gathered(world: int, n: int, block: int) -> torch.Tensor:
    """Rows as the hook's all-gather leaves them: ``[scales as bytes | q as bytes]`` per rank."""
    rows = []
    for _ in range(world):
        q, scales, *_ = int8.quantize_ef_torch(torch.randn(n), None, block)
        rows.append(torch.cat([scales.view(torch.uint8), q.view(torch.uint8)]))
    return torch.stack(rows)


@pytest.mark.parametrize(("n", "block"), CASES)
@pytest.mark.parametrize("world", [1, 3])
def test_dequantize_accumulate_matches_twin(n: int, block: int, world: int) -> None:
    rows = _gathered(world, n, block)
    out = _triton().dequantize_accumulate(rows, n, block)
    assert_close(out, int8.dequantize_accumulate_torch(rows, n, block), torch.float32)


def test_dequantize_twin_is_the_trainers_loop() -> None:
    n, block, world = 300, 64, 3
    rows = _gathered(world, n, block)
    nb = int8.n_blocks(n, block)
    total = torch.zeros(n)
    for r in range(world):
        scales_r = rows[r, : 4 * nb].clone().view(torch.float32)
        total += dequantize_int8(rows[r, 4 * nb:].view(torch.int8), scales_r, block)
    assert torch.equal(int8.dequantize_accumulate_torch(rows, n, block), total.div_(world))


def test_opcheck() -> None:
    g, r = torch.randn(200), torch.randn(200)
    torch.library.opcheck(int8.int8_quantize_ef, (g, r, 64))
    torch.library.opcheck(int8.int8_quantize_ef, (g, None, 64))
    torch.library.opcheck(int8.int8_dequantize_accumulate, (_gathered(2, 200, 64), 200, 64))


def test_dispatch_runs_the_twin_on_cpu_and_triton_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g, r = torch.randn(300), torch.randn(300)
    ran: list[str] = []
    kernel, twin = _triton().quantize_ef, int8.quantize_ef_torch
    monkeypatch.setattr(_triton(), "quantize_ef",
                        lambda *a: ran.append("triton") or kernel(*a))
    monkeypatch.setattr(int8, "quantize_ef_torch", lambda *a: ran.append("torch") or twin(*a))
    int8.quantize_ef(g, r, 64)
    assert ran == ["torch"]  # a CPU tensor: the twin
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)  # what a CUDA tensor gets
    int8.quantize_ef(g, r, 64)
    assert ran == ["torch", "triton"]
