"""Every attention path against the naive fp32 oracle, plus the mask rule's own properties."""

from __future__ import annotations

import pytest
import torch

from traind.trainer.attention import (
    HAS_FLEX,
    allowed,
    attend,
    mask_matrix,
    naive_attention,
)
from traind.trainer.config import ModelConfig

needs_flex = pytest.mark.skipif(not HAS_FLEX, reason="torch has no flex_attention")
# Eager flex on CPU is the unfused reference path on purpose here (it is being checked, not timed).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# (B, nh, T, hs, window, global_tokens): odd T (not a multiple of flex's 128 block), window of 1
# (only itself), window >= T (plain causal), sinks inside and beyond the window, and a T that
# spans more than one flex block.
CASES = [
    (1, 1, 8, 4, 1, 0),
    (2, 2, 17, 8, 4, 0),
    (2, 3, 33, 16, 8, 2),
    (1, 2, 40, 8, 64, 0),
    (1, 2, 40, 8, 40, 3),
    (3, 1, 29, 8, 5, 12),
    (1, 2, 150, 8, 16, 4),
]


def sliding(window: int, global_tokens: int = 0) -> ModelConfig:
    return ModelConfig(attention="sliding_window", window=window, global_tokens=global_tokens)


def qkv(B: int, nh: int, T: int, hs: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, T, hs, generator=g) for _ in range(3)]  # (B, nh, T, hs) each


@pytest.mark.parametrize(
    ("q", "kv", "window", "global_tokens", "expected"),
    [
        (5, 5, 1, 0, True),  # itself, always
        (5, 6, 100, 100, False),  # the future, never, not even a sink
        (5, 4, 1, 0, False),  # window 1 is only itself
        (5, 2, 4, 0, True),  # 3 back: inside a window of 4
        (5, 1, 4, 0, False),  # 4 back: just outside
        (5, 1, 4, 2, True),  # ... but a sink
        (5, 2, 3, 2, False),  # outside the window and not among the first 2
        (0, 0, 1, 0, True),
    ],
)
def test_allowed_table(q: int, kv: int, window: int, global_tokens: int, expected: bool) -> None:
    assert allowed(torch.tensor(q), torch.tensor(kv), window, global_tokens).item() is expected


def test_mask_matrix_rows() -> None:
    m = mask_matrix(6, window=2, global_tokens=1)
    assert m.dtype == torch.bool and m.shape == (6, 6)
    assert m[5].tolist() == [True, False, False, False, True, True]  # sink, then 2 most recent
    assert m.diagonal().all()  # no row is empty, so no softmax of all -inf
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert mask_matrix(6, window=6, global_tokens=0).equal(causal)


@pytest.mark.parametrize(("B", "nh", "T", "hs", "window", "global_tokens"), CASES)
@pytest.mark.parametrize("backend", ["sdpa_mask", pytest.param("flex", marks=needs_flex), "auto"])
def test_sliding_paths_match_naive(
    B: int, nh: int, T: int, hs: int, window: int, global_tokens: int, backend: str
) -> None:
    q, k, v = qkv(B, nh, T, hs)
    expected = naive_attention(q, k, v, mask_matrix(T, window, global_tokens))
    out = attend(q, k, v, cfg=sliding(window, global_tokens), backend=backend)  # type: ignore[arg-type]
    assert out.shape == (B, nh, T, hs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("B", "nh", "T", "hs"), [(1, 1, 8, 4), (2, 3, 33, 16), (2, 2, 64, 8)])
def test_full_is_naive_causal(B: int, nh: int, T: int, hs: int) -> None:
    q, k, v = qkv(B, nh, T, hs)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = attend(q, k, v, cfg=ModelConfig(attention="full"))
    torch.testing.assert_close(out, naive_attention(q, k, v, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("global_tokens", [0, 3])
@pytest.mark.parametrize("backend", ["sdpa_mask", pytest.param("flex", marks=needs_flex)])
def test_changing_a_token_never_changes_earlier_outputs(global_tokens: int, backend: str) -> None:
    T, cfg = 24, sliding(5, global_tokens)
    q, k, v = qkv(2, 2, T, 8)
    base = attend(q, k, v, cfg=cfg, backend=backend)  # type: ignore[arg-type]
    for t in (0, 2, 11, 23):
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, :, t] += 1.0
        out = attend(q2, k2, v2, cfg=cfg, backend=backend)  # type: ignore[arg-type]
        torch.testing.assert_close(out[:, :, :t], base[:, :, :t], atol=0, rtol=0)
        assert not torch.allclose(out[:, :, t], base[:, :, t])  # and position t does see it


@pytest.mark.parametrize("backend", ["sdpa_mask", pytest.param("flex", marks=needs_flex)])
def test_tokens_beyond_the_window_have_no_influence(backend: str) -> None:
    T, window, pos = 24, 5, 20
    q, k, v = qkv(1, 2, T, 8)
    cfg = sliding(window)
    base = attend(q, k, v, cfg=cfg, backend=backend)  # type: ignore[arg-type]
    for far in (0, 7, pos - window):  # pos - window: the nearest key it must not see
        k2, v2 = k.clone(), v.clone()
        k2[:, :, far] += 10.0
        v2[:, :, far] += 10.0
        out = attend(q, k2, v2, cfg=cfg, backend=backend)  # type: ignore[arg-type]
        torch.testing.assert_close(out[:, :, pos], base[:, :, pos], atol=0, rtol=0)
    # the oldest key inside the window does count
    k2, v2 = k.clone(), v.clone()
    v2[:, :, pos - window + 1] += 10.0
    out = attend(q, k2, v2, cfg=cfg, backend=backend)  # type: ignore[arg-type]
    assert not torch.allclose(out[:, :, pos], base[:, :, pos])


def test_sinks_reach_every_later_position() -> None:
    T = 24
    q, k, v = qkv(1, 2, T, 8)
    cfg = sliding(window=4, global_tokens=2)
    base = attend(q, k, v, cfg=cfg, backend="sdpa_mask")
    v2 = v.clone()
    v2[:, :, 1] += 10.0  # a sink, far outside every late window
    out = attend(q, k, v2, cfg=cfg, backend="sdpa_mask")
    assert not torch.allclose(out[:, :, T - 1], base[:, :, T - 1])
    v3 = v.clone()
    v3[:, :, 2] += 10.0  # the first token that is not a sink
    out = attend(q, k, v3, cfg=cfg, backend="sdpa_mask")
    torch.testing.assert_close(out[:, :, T - 1], base[:, :, T - 1], atol=0, rtol=0)


def _grads(fn: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)  # type: ignore[operator]
    # a fixed random weighting, so the gradient is not the trivial one of a plain sum
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    return [x.grad for x in leaves]  # type: ignore[misc]


@pytest.mark.parametrize(("window", "global_tokens"), [(4, 0), (6, 3), (64, 0)])
def test_gradients_flow_and_match_naive(window: int, global_tokens: int) -> None:
    T = 30
    q, k, v = qkv(2, 2, T, 8)
    mask = mask_matrix(T, window, global_tokens)
    cfg = sliding(window, global_tokens)
    want = _grads(lambda a, b, c: naive_attention(a, b, c, mask), q, k, v)
    got = _grads(lambda a, b, c: attend(a, b, c, cfg=cfg, backend="sdpa_mask"), q, k, v)
    for g, w in zip(got, want, strict=True):
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    if window < T:
        # a key the last query cannot see gets gradient only from the queries that can
        only_late = _grads(
            lambda a, b, c: attend(a, b, c, cfg=cfg, backend="sdpa_mask")[:, :, -1:], q, k, v
        )
        assert only_late[1][:, :, global_tokens : T - window].abs().max() == 0


@needs_flex
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex has no CPU backward")
def test_flex_gradients_match_naive_on_cuda() -> None:
    T = 130
    q, k, v = (x.cuda() for x in qkv(2, 2, T, 16))
    mask = mask_matrix(T, 16, 2, "cuda")
    cfg = sliding(16, 2)
    want = _grads(lambda a, b, c: naive_attention(a, b, c, mask), q, k, v)
    got = _grads(lambda a, b, c: attend(a, b, c, cfg=cfg, backend="flex"), q, k, v)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_flex_refuses_dropout() -> None:
    q, k, v = qkv(1, 1, 8, 4)
    with pytest.raises(ValueError, match="dropout"):
        attend(q, k, v, cfg=sliding(2), dropout_p=0.1, backend="flex")
