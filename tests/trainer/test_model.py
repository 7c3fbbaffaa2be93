from __future__ import annotations

import math
from typing import Any

import pytest
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
    # the attention that runs: a causal query sees (T + 1) / 2 = 8.5 keys of T = 16
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 8.5


@pytest.mark.parametrize(("t", "window", "sinks"), [(16, 4, 0), (16, 4, 2), (16, 16, 3),
                                                     (9, 3, 5), (32, 1, 0)])
def test_attended_keys_count_what_the_mask_lets_through(t: int, window: int, sinks: int
                                                        ) -> None:
    from traind.trainer.attention import mask_matrix
    from traind.trainer.model import attended_keys

    cfg = ModelConfig(seq_len=t, attention="sliding_window", window=window,
                      global_tokens=sinks)
    allowed = mask_matrix(t, window, sinks).sum().item()  # the keys the kernel attends to
    assert attended_keys(cfg) == pytest.approx(allowed / t)
    full = ModelConfig(seq_len=t)
    assert attended_keys(full) == pytest.approx(torch.ones(t, t).tril().sum().item() / t)


def test_residual_projections_get_scaled_init() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, n_layers=8, n_heads=4)
    block = GPT(cfg).blocks[0]
    assert abs(block.attn.q.weight.std().item() - 0.02) < 0.002
    expected = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert abs(block.attn.proj.weight.std().item() - expected) < 0.001


def _loss_and_grads(
    cfg: ModelConfig, idx: torch.Tensor, block_calls: list[int] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients of a fresh seeded model; ``block_calls`` gets one entry per
    block forward (a recomputation included)."""
    torch.manual_seed(0)  # the same weights for every variant
    model = GPT(cfg).train()
    if block_calls is not None:
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda *_, i=i: block_calls.append(i))
    _, loss = model(idx, idx.roll(-1, dims=1))
    assert loss is not None
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["full", "sliding_window"])
@pytest.mark.parametrize(
    ("checkpointing", "offload"), [(True, False), (False, True), (True, True)]
)
def test_memory_savers_leave_loss_and_gradients_unchanged(
    attention: str, checkpointing: bool, offload: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = CFG.model_copy(update={"attention": attention, "window": 5, "global_tokens": 1})
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain_loss, plain_grads = _loss_and_grads(base, idx)

    # a spy, to prove the offload ran rather than only that nothing changed
    real_save_on_cpu = torch.autograd.graph.save_on_cpu
    pins: list[bool] = []

    def spy_save_on_cpu(pin_memory: bool = False) -> Any:
        pins.append(pin_memory)
        return real_save_on_cpu(pin_memory=pin_memory)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", spy_save_on_cpu)
    cfg = base.model_copy(
        update={"activation_checkpointing": checkpointing, "activation_offload": offload}
    )
    calls: list[int] = []
    loss, grads = _loss_and_grads(cfg, idx, calls)

    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=0)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], atol=1e-6, rtol=0, msg=name)
    # each block runs once in forward, and once more in backward (last block first) when
    # its activations were dropped
    assert calls == ([0, 1, 1, 0] if checkpointing else [0, 1])
    assert pins == ([False] if offload else [])  # CPU tensors: nothing to pin


def test_memory_savers_are_off_in_eval() -> None:
    cfg = CFG.model_copy(update={"activation_checkpointing": True, "activation_offload": True})
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits, _ = model(idx)
    torch.manual_seed(0)
    torch.testing.assert_close(logits, GPT(CFG).eval()(idx)[0].detach(), atol=0, rtol=0)


def test_sliding_window_receptive_field_grows_by_layer() -> None:
    # each layer reaches window - 1 further back, so position q sees back to q - L·(window - 1)
    window, layers = 3, 2
    cfg = CFG.model_copy(update={"attention": "sliding_window", "window": window})
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 256, (1, 16))
    base, _ = model(idx)
    t = 4
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    out, _ = model(changed)
    reach = t + layers * (window - 1)  # the last position token t can influence
    torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)
    assert not torch.allclose(out[:, reach], base[:, reach])
    torch.testing.assert_close(out[:, reach + 1 :], base[:, reach + 1 :], atol=0, rtol=0)


def test_sliding_window_model_trains() -> None:
    cfg = CFG.model_copy(update={"attention": "sliding_window", "window": 4, "global_tokens": 1})
    torch.manual_seed(0)
    model = GPT(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # a repeating pattern longer than the window: learnable only through what the window sees
    idx = torch.arange(17).remainder(7).repeat(4, 1)  # (4, 17)
    x, y = idx[:, :-1], idx[:, 1:]
    _fits(model, opt, x, y, steps=15)


def test_a_checkpoint_with_fused_projections_still_loads() -> None:
    """Checkpoints written before q/k/v and gate/up were split hold one fused weight each
    (rows stacked in that order): they load into the split model unchanged in meaning."""
    torch.manual_seed(0)
    model = GPT(CFG)
    state = model.state_dict()
    for prefix, fused, parts in (("blocks.0.attn.", "qkv", "qkv"),
                                 ("blocks.0.mlp.", "gate_up", ("gate", "up"))):
        state[f"{prefix}{fused}.weight"] = torch.cat(
            [state.pop(f"{prefix}{p}.weight") for p in parts])
    other = GPT(CFG)
    other.load_state_dict(state)  # strict: every split key is filled
    for name, p in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], p), name


# Grouped-query attention and tied embeddings (model.n_kv_heads, model.tie_embeddings)


def test_gqa_shapes_and_projection_widths() -> None:
    cfg = CFG.model_copy(update={"n_kv_heads": 2})  # 4 query heads of 8, 2 kv heads
    torch.manual_seed(0)
    model = GPT(cfg)
    attn = model.blocks[0].attn
    assert attn.q.weight.shape == (32, 32)
    assert attn.k.weight.shape == attn.v.weight.shape == (2 * 8, 32)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256) and loss is not None
    assert model.num_params() == GPT(CFG).num_params() - 2 * 2 * (32 - 16) * 32


def test_gqa_with_as_many_kv_heads_is_the_multi_head_model() -> None:
    """n_kv_heads = n_heads (or 0) is today's model: the same state-dict keys and shapes (old
    checkpoints load), and from the same seed the same weights and logits."""
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    mha = GPT(CFG).eval()
    torch.manual_seed(0)
    gqa = GPT(CFG.model_copy(update={"n_kv_heads": 4})).eval()
    old, new = mha.state_dict(), gqa.state_dict()
    assert {k: v.shape for k, v in old.items()} == {k: v.shape for k, v in new.items()}
    gqa.load_state_dict(old)  # strict
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=0, rtol=0)


def test_gqa_repeats_each_kv_head_for_its_group() -> None:
    """Query head i reads kv head i // group: a GQA model equals the multi-head model whose
    k and v weights repeat each kv head's rows for its group."""
    cfg = CFG.model_copy(update={"n_kv_heads": 2})
    torch.manual_seed(0)
    gqa = GPT(cfg).eval()
    mha = GPT(CFG).eval()
    state = gqa.state_dict()
    hs = 8
    for key in [k for k in state if k.endswith(("attn.k.weight", "attn.v.weight"))]:
        heads = state[key].view(2, hs, 32)  # (nkv, hs, C)
        state[key] = heads.repeat_interleave(2, dim=0).reshape(32, 32)  # (nh * hs, C)
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["full", "sliding_window"])
def test_multi_query_attention_trains(attention: str) -> None:
    cfg = CFG.model_copy(update={"n_kv_heads": 1, "attention": attention, "window": 6})
    torch.manual_seed(0)
    model = GPT(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]  # random bytes: learnable only by memorising them
    _fits(model, opt, x, y, steps=20)


def test_tied_embeddings_share_one_parameter() -> None:
    from traind.trainer.config import OptimConfig
    from traind.trainer.optim import build_optimizer

    cfg = CFG.model_copy(update={"tie_embeddings": True})
    torch.manual_seed(0)
    model = GPT(cfg)
    assert model.head.weight is model.tok_emb.weight
    untied = GPT(CFG)
    assert model.num_params() == untied.num_params() - 256 * 32
    # the table is the head's matmul too: its FLOPs count, the same as an untied head's
    assert model.num_params(non_embedding=True) == model.num_params()
    assert model.flops_per_token() == untied.flops_per_token()
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    # both names are in a checkpoint, so tied and untied checkpoints load either way
    state = model.state_dict()
    assert torch.equal(state["head.weight"], state["tok_emb.weight"])
    GPT(cfg).load_state_dict(state)
    # a step moves the one weight (its gradient: the sum of both uses')
    before = model.tok_emb.weight.detach().clone()
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    assert loss is not None
    loss.backward()
    opt.step()
    assert model.head.weight is model.tok_emb.weight
    assert not torch.equal(model.tok_emb.weight, before)


def test_layer_groups_with_tied_embeddings() -> None:
    from traind.trainer.model import layer_groups

    model = GPT(CFG.model_copy(update={"tie_embeddings": True}))
    groups = layer_groups(model)
    assert list(groups) == ["embed", "block.0", "block.1", "head"]
    # the one weight belongs to both the embedding's group and the head's
    assert groups["embed"][0].weight is groups["head"][1].weight


def test_footprint_counts_what_the_model_holds() -> None:
    from traind.trainer.footprint import param_count

    for update in ({}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "tie_embeddings": True},
                   {"tie_embeddings": True}):
        cfg = CFG.model_copy(update=update)
        assert param_count(cfg) == GPT(cfg).num_params(), update


@pytest.mark.parametrize(("fields", "says"), [
    ({"n_kv_heads": 3}, "n_kv_heads: 3 must divide n_heads (4)"),
    ({"n_kv_heads": 8}, "n_kv_heads: 8 must divide n_heads (4)"),
    ({"n_kv_heads": -1}, "n_kv_heads"),
])
def test_bad_kv_heads_name_the_field(fields: dict[str, Any], says: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as exc:
        ModelConfig(d_model=32, n_heads=4, **fields)
    assert says in str(exc.value)


def test_bad_kv_heads_have_the_fields_path() -> None:
    """The rule's error carries its path (a FieldErrors inside pydantic's), so the config
    loader (and a form) put it on model.n_kv_heads rather than on the model node."""
    from pydantic import ValidationError

    from traind.errors import FieldErrors
    from traind.trainer.config import TrainConfig

    with pytest.raises(ValidationError) as exc:
        TrainConfig.model_validate({"model": {"n_kv_heads": 3}})
    [err] = exc.value.errors()
    inner = err["ctx"]["error"]
    assert err["loc"] == ("model",) and isinstance(inner, FieldErrors)
    assert [loc for loc, _ in inner.errors] == [("n_kv_heads",)]


def _fits(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor, *, steps: int) -> None:
    """``steps`` optimizer steps on one batch more than halve the loss, every loss finite."""
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(math.isfinite(v) for v in losses)
