"""kernels/topk.py: top-k with error feedback, the fused residual pass against the twin."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import RTOL
from traind.kernels import _dispatch, topk
from traind.trainer.compression._math import (
    error_feedback,
    squared_error,
    topk_compress,
    topk_count,
    topk_decompress,
)

CASES = [(1000, 0.01), (3001, 0.1), (77, 0.5), (5, 1.0)]  # n never a multiple of 1024


def _triton():
    return _dispatch.triton_module("_topk_triton")


def _sorted(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = indices.argsort()  # sorted=False: compare as sets
    return values[order], indices[order]


@pytest.mark.parametrize(("n", "ratio"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_topk_ef_matches_twin(n: int, ratio: float, dtype: torch.dtype,
                              with_residual: bool) -> None:
    g = torch.randn(n).to(dtype)
    r = torch.randn(n) * 0.01 if with_residual else None
    k = topk_count(n, ratio)
    values, indices, res, err, ref = _triton().topk_ef(g, r, k)
    tvalues, tindices, tres, terr, tref = topk.topk_ef_torch(g, r, k)
    v, i = _sorted(values, indices)
    tv, ti = _sorted(tvalues, tindices)
    assert torch.equal(i, ti) and torch.equal(v, tv)
    assert torch.equal(res, tres)  # elementwise fp32, no rounding to differ
    torch.testing.assert_close(err, terr, rtol=RTOL[torch.float32], atol=1e-9)
    torch.testing.assert_close(ref, tref, rtol=RTOL[torch.float32], atol=1e-9)


@pytest.mark.parametrize(("n", "ratio"), CASES)
def test_twin_is_the_trainers_code_bit_for_bit(n: int, ratio: float) -> None:
    g, r = torch.randn(n), torch.randn(n) * 0.01
    fb = error_feedback(g, r, lambda x: topk_compress(x, ratio),
                        lambda p: topk_decompress(p[0], p[1], n))
    err, ref = squared_error(fb.x, fb.x_hat)
    values, indices, res, terr, tref = topk.topk_ef_torch(g, r, topk_count(n, ratio))
    for mine, theirs in [(values, fb.payload[0]), (indices, fb.payload[1]),
                         (res, fb.residual), (terr, err), (tref, ref)]:
        assert torch.equal(mine, theirs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf - inf, as intended
def test_non_finite_values_are_sent_and_zeroed_in_the_residual() -> None:
    g = torch.randn(500)
    g[3], g[400] = float("inf"), float("nan")
    values, _, res, _, _ = _triton().topk_ef(g, None, 10)
    tvalues, _, tres, _, _ = topk.topk_ef_torch(g, None, 10)
    assert torch.isinf(values).any() and torch.isinf(tvalues).any()
    assert torch.isfinite(res).all() and torch.equal(res, tres)


def test_opcheck() -> None:
    g, r = torch.randn(2000), torch.randn(2000)
    torch.library.opcheck(topk.topk_ef_op, (g, r, 20))
    torch.library.opcheck(topk.topk_ef_op, (g, None, 20))


def test_dispatch_runs_the_twin_on_cpu_and_triton_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.randn(300)
    ran: list[str] = []
    kernel, twin = _triton().topk_ef, topk.topk_ef_torch
    monkeypatch.setattr(_triton(), "topk_ef", lambda *a: ran.append("triton") or kernel(*a))
    monkeypatch.setattr(topk, "topk_ef_torch", lambda *a: ran.append("torch") or twin(*a))
    topk.topk_ef(g, None, 3)
    assert ran == ["torch"]
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    topk.topk_ef(g, None, 3)
    assert ran == ["torch", "triton"]
