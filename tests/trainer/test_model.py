from __future__ import annotations

import math

import torch

from traind.trainer.config import ModelConfig
from traind.trainer.model import GPT, apply_rope, mlp_hidden_width, rope_cache

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)


def test_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256)
    assert loss is not None and loss.shape == ()
    # small init: predictions start near uniform over the 256 bytes
    assert abs(loss.item() - math.log(256)) < 0.5
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, 256) and loss is None


def test_changing_a_token_never_changes_earlier_logits() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    idx = torch.randint(0, 256, (2, 16))
    base, _ = model(idx)
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        out, _ = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t])  # and position t does see it


def test_rope_depends_only_on_relative_position() -> None:
    hs, T = 8, 32
    cos, sin = rope_cache(T, hs, 10000.0)
    q, k = torch.randn(hs), torch.randn(hs)
    # the same vector at every position: (1, 1, T, hs)
    rq = apply_rope(q.expand(1, 1, T, hs), cos, sin)[0, 0]  # (T, hs)
    rk = apply_rope(k.expand(1, 1, T, hs), cos, sin)[0, 0]  # (T, hs)
    torch.testing.assert_close(rq[0], q)  # position 0 is the identity
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(T))  # rotations keep norms
    scores = rq @ rk.T  # (T, T): <q at m, k at n>
    for offset in (0, 3, 7):
        diag = torch.diagonal(scores, offset=-offset)  # all pairs with m - n = offset
        torch.testing.assert_close(diag, diag[0].expand_as(diag), atol=1e-5, rtol=1e-5)


def test_rope_buffers_are_not_checkpointed() -> None:
    keys = GPT(CFG).state_dict().keys()
    assert not any("rope" in k for k in keys)


def test_sizes_and_flops() -> None:
    assert mlp_hidden_width(ModelConfig(d_model=128)) == 352  # 8/3 * 128 = 341.3 -> 352
    assert mlp_hidden_width(ModelConfig(d_model=128, mlp_hidden=100)) == 100
    model = GPT(CFG)
    n = model.num_params(non_embedding=True)
    assert model.num_params() == n + 256 * 32
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 16


def test_residual_projections_get_scaled_init() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, n_layers=8, n_heads=4)
    block = GPT(cfg).blocks[0]
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 0.002
    expected = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert abs(block.attn.proj.weight.std().item() - expected) < 0.001
