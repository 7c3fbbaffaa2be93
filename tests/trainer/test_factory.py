"""The user's own model (model.factory): trained, observed per named module, under DDP with
compression and under FSDP2 with bf16 on real gloo ranks, and refused with the field named
when it cannot be used."""

from __future__ import annotations

import math
import os
import textwrap
from typing import TYPE_CHECKING

import pytest
import torch

from tests.trainer.mesh_runs import config, run_ranks
from traind.contracts.events import ArmEvent, LayerEvent, LifecycleEvent, StepEvent
from traind.errors import FieldErrors
from traind.trainer.config import ModelConfig, TrainConfig
from traind.trainer.factory import UserModel, build_user_model, load_factory
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

# A model traind has never seen: GRU layers in a ModuleList, its own names, logits out; and a
# second that computes its own loss from the targets.
USER_MODELS = textwrap.dedent('''
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Recurrent(nn.Module):
        def __init__(self, vocab_size, width, depth):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, width)
            self.layers = nn.ModuleList(nn.GRU(width, width, batch_first=True)
                                        for _ in range(depth))
            self.readout = nn.Linear(width, vocab_size)

        def forward(self, idx):
            x = self.embed(idx)
            for layer in self.layers:
                x = x + layer(x)[0]
            return self.readout(x)

    def recurrent(vocab_size, d_model, n_layers=2):
        return Recurrent(vocab_size, d_model, n_layers)

    class WithLoss(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.table = nn.Embedding(vocab, vocab)

        def forward(self, idx, targets):
            return F.cross_entropy(self.table(idx).flatten(0, 1), targets.flatten())

    def bigram(config):
        return WithLoss(config.vocab_size)

    # Llama-like, with its own names and the tensor-parallel plan it carries; its heads come
    # from the local width (view(b, t, -1, head)), so a column-parallel q holds half of them
    class Attention(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.head = width // heads
            self.q, self.k, self.v, self.out = (nn.Linear(width, width, bias=False)
                                                for _ in range(4))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (f(x).view(b, t, -1, self.head).transpose(1, 2)
                       for f in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, -1))

    class Layer(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = Attention(width, heads)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Llamaish(nn.Module):
        tp_plan = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
                   "layers.*.attn.v": "colwise", "layers.*.attn.out": "rowwise",
                   "layers.*.up": "colwise", "layers.*.down": "rowwise"}

        def __init__(self, vocab, width, heads, depth):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList(Layer(width, heads) for _ in range(depth))
            self.norm, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            x = self.embed(idx)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    def llamaish(vocab_size, d_model, n_heads, n_layers):
        return Llamaish(vocab_size, d_model, n_heads, n_layers)

    def llamaish_with_plan(vocab_size, d_model, n_heads, n_layers, plan):
        model = Llamaish(vocab_size, d_model, n_heads, n_layers)
        model.tp_plan = plan
        return model

    def not_a_module(vocab_size):
        return "model"

    class MaskedWrapper(nn.Module):
        # What a user writes around a model: the mask, when given, changes the logits.
        def __init__(self, vocab):
            super().__init__()
            self.embed, self.out = nn.Embedding(vocab, 16), nn.Linear(16, vocab)
            self.masks = []

        def forward(self, input_ids, attention_mask=None):
            self.masks.append(attention_mask)
            h = self.embed(input_ids)
            if attention_mask is not None:
                h = h * attention_mask.unsqueeze(-1).float()
            return self.out(h)

    def masked(vocab_size):
        return MaskedWrapper(vocab_size)

    class NeedsMask(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.out = nn.Embedding(vocab, vocab)

        def forward(self, input_ids, attention_mask):
            return self.out(input_ids)

    def needs_mask(vocab_size):
        return NeedsMask(vocab_size)

    def hf_llama(vocab_size, seq_len):
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len))

    def hf_gpt2(vocab_size, seq_len):
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2,
                                          n_head=4, n_positions=seq_len))

    def needs_more(vocab_size, hidden_units):
        return nn.Linear(1, 1)
''')


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The module above, importable here and in worker processes; its name."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_models.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path / "lib"), os.environ.get("PYTHONPATH")) if p))
    return "my_models"


def _with_factory(cfg: TrainConfig, factory: str, **model: object) -> TrainConfig:
    return cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"factory": factory, **model})})


def test_a_factory_model_trains_and_its_named_modules_are_observed(
        tmp_path: Path, user_models: str, make_config: Callable[..., TrainConfig]) -> None:
    cfg = _with_factory(make_config(tmp_path / "run", steps=40), f"{user_models}:recurrent")
    sink = ListSink()
    result = train(cfg, sink)
    losses = [e.loss for e in sink.events if isinstance(e, StepEvent)]
    assert result.step == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    layers = next(e for e in sink.events if isinstance(e, LayerEvent))
    assert layers.layers == ["embed", "layers.0", "layers.1", "readout"]
    assert all(g > 0 for g in layers.grad_norm)
    started = next(e for e in sink.events if isinstance(e, LifecycleEvent))
    model = build_user_model(cfg.model)
    assert started.detail["params"] == model.num_params()
    # 6N of the non-embedding parameters (the attention term needs shapes it cannot read)
    assert started.detail["flops_per_token"] == 6 * (model.num_params() - 256 * 32)


def test_a_factory_model_may_compute_its_own_loss(
        tmp_path: Path, user_models: str, make_config: Callable[..., TrainConfig]) -> None:
    cfg = _with_factory(make_config(tmp_path / "run", steps=20), f"{user_models}:bigram")
    sink = ListSink()
    assert train(cfg, sink).step == 20
    losses = [e.loss for e in sink.events if isinstance(e, StepEvent)]
    assert losses[-1] < losses[0]
    logits, loss = UserModel(load_factory(f"{user_models}:bigram")(ModelConfig()))(
        torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert logits is None and loss is not None and loss.dim() == 0


def test_a_factory_model_takes_interleaved_precision_arms(
        tmp_path: Path, user_models: str, make_config: Callable[..., TrainConfig]) -> None:
    # the A/B scheduler's arms switch precision at block boundaries in the running job
    base = _with_factory(make_config(tmp_path / "run", steps=12), f"{user_models}:recurrent")
    cfg = TrainConfig.model_validate({**base.model_dump(), "interleave": {
        "arms": [{"name": "fp32", "precision": "fp32"}, {"name": "bf16", "precision": "bf16"}],
        "block_steps": 3, "warmup_steps": 1}})
    sink = ListSink()
    train(cfg, sink)
    blocks = [(e.arm, e.block) for e in sink.events if isinstance(e, ArmEvent)]
    assert blocks == [("fp32", 0), ("bf16", 1), ("bf16", 2), ("fp32", 3)]
    assert all(math.isfinite(e.loss) for e in sink.events if isinstance(e, ArmEvent))


def test_a_wrapper_with_an_attention_mask_gets_the_ids_by_name_and_trains_right(
        user_models: str) -> None:
    """Issue 41: traind called any two-parameter forward as forward(idx, targets), so
    forward(input_ids, attention_mask=None) took the targets as its mask: logits off by up to
    0.18, no error. Now the forward is called by name: the mask keeps its default."""
    torch.manual_seed(0)
    inner = load_factory(f"{user_models}:masked")(64)
    model = UserModel(inner)
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(1, 64, (2, 8))
    logits, loss = model(idx, targets)
    assert inner.masks == [None]
    want = inner(idx)
    assert torch.equal(logits, want)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(
        want.view(16, -1), targets.view(16)))


def test_a_forward_traind_cannot_call_is_refused_naming_what_it_needs(
        user_models: str) -> None:
    with pytest.raises(FieldErrors) as err:
        build_user_model(ModelConfig(factory=f"{user_models}:needs_mask"))
    assert err.value.errors[0][0] == ("model", "factory")
    assert "NeedsMask.forward needs attention_mask" in str(err.value)


@pytest.mark.parametrize("factory", ["hf_llama", "hf_gpt2"])
def test_a_hugging_face_model_as_it_is_gives_its_logits_and_traind_s_loss(
        user_models: str, factory: str) -> None:
    """A raw transformers causal LM: called with input_ids= and use_cache=False, its output
    object's .logits read, never handed traind's targets as labels (it would shift them
    again)."""
    torch.manual_seed(0)
    inner = load_factory(f"{user_models}:{factory}")(vocab_size=64, seq_len=16)
    model = UserModel(inner).eval()  # GPT-2's dropout off: the two calls compare exactly
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    logits, loss = model(idx, targets)
    want = inner(input_ids=idx).logits
    assert logits is not None and torch.allclose(logits, want)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(
        want.float().view(32, -1), targets.view(32)))


def test_a_hugging_face_llama_trains_through_its_factory(
        tmp_path: Path, user_models: str, make_config: Callable[..., TrainConfig]) -> None:
    cfg = _with_factory(make_config(tmp_path / "run", steps=30), f"{user_models}:hf_llama")
    sink = ListSink()
    assert train(cfg, sink).step == 30
    losses = [e.loss for e in sink.events if isinstance(e, StepEvent)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses


@pytest.mark.parametrize(("factory", "reason"), [
    ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
    ("{m}:missing", "has no function 'missing'"),
    ("{m}:not_a_module", "returned str, not an nn.Module"),
    ("{m}:needs_more", "parameter 'hidden_units' is not a model.* field"),
])
def test_a_factory_that_cannot_be_used_is_refused_naming_the_field(
        user_models: str, factory: str, reason: str) -> None:
    cfg = ModelConfig(factory=factory.format(m=user_models))
    with pytest.raises(FieldErrors) as err:
        build_user_model(cfg)
    assert err.value.errors[0][0] == ("model", "factory") and reason in str(err.value)


def test_the_config_refuses_a_factory_with_what_it_cannot_have() -> None:
    with pytest.raises(ValueError, match=r"a model\.factory model saves memory"):
        ModelConfig(factory="os:getcwd", activation_checkpointing=True)
    with pytest.raises(ValueError, match="pattern"):
        ModelConfig(factory="os.getcwd")
    with pytest.raises(ValueError, match=r"model\.factory: a factory model with "
                       r"parallel\.pp = 2 > 1 needs a split into pipeline stages"):
        TrainConfig.model_validate({"model": {"factory": "os:getcwd"},
                                    "job": {"nproc_per_node": 2}, "parallel": {"pp": 2}})
    # tensor parallel takes the module's own plan, known once the worker has built it
    TrainConfig.model_validate({"model": {"factory": "os:getcwd"},
                                "job": {"nproc_per_node": 2}, "parallel": {"tp": 2}})


@pytest.mark.parametrize(("plan", "reason"), [
    (None, "Recurrent carries no tp_plan"),
    ({"layers.*.attn.q": "diagonal"}, "tp_plan['layers.*.attn.q'] is 'diagonal'"),
    ({"layers.*.attn.query": "colwise"}, "tp_plan['layers.*.attn.query'] names no module"),
])
def test_tensor_parallel_refuses_a_factory_model_without_a_usable_plan(
        user_models: str, plan: dict[str, str] | None, reason: str) -> None:
    from traind.trainer.tensor_parallel import user_plan

    factory = load_factory(f"{user_models}:{'recurrent' if plan is None else 'llamaish_with_plan'}")
    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=2)
    model = UserModel(factory(cfg.vocab_size, cfg.d_model, n_layers=2) if plan is None else
                      factory(cfg.vocab_size, cfg.d_model, cfg.n_heads, 2, plan))
    with pytest.raises(FieldErrors) as err:
        user_plan(model)
    assert err.value.errors[0][0] == ("model", "factory") and reason in str(err.value)
    good = UserModel(load_factory(f"{user_models}:llamaish")(256, 32, 4, 2))
    assert sorted(user_plan(good)) == sorted(good.inner.tp_plan)


@pytest.mark.parametrize("layout", ["tp2", "dp2-tp2-fsdp"])
def test_a_factory_model_follows_one_rank_under_its_own_tensor_parallel_plan(
        tmp_path: Path, user_models: str, layout: str) -> None:
    """tp2 over the module's plan: each rank holds half the heads and half the MLP (column
    then row parallel), its plain layers (embedding, norms, head) replicated; clipping takes
    the norm over both kinds. dp2 x tp2 (four ranks): the same plan inside each dp half, FSDP2
    sharding both kinds over dp (2D), against one rank of the whole batch. fp32, relative per
    step, as tests/trainer/test_tensor_parallel (reordered float32 sums)."""
    from tests.trainer.test_tensor_parallel import FP32_RTOL, assert_close, losses, one_rank

    model = {"factory": f"{user_models}:llamaish"}
    dp = 2 if layout.startswith("dp2") else 1
    parallel: dict[str, object] = {"tp": 2, **({"strategy": "fsdp"} if dp > 1 else {})}
    reference = one_rank(config(tmp_path / "one", batch=4 * dp, model=model))
    ranks = run_ranks(tmp_path / "tp", config(tmp_path / "tp", batch=4, ranks=2 * dp,
                                              parallel=parallel, model=model,
                                              telemetry={"per_layer": True}), 2 * dp)
    started = next(e for e in ranks[0] if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started.detail["mesh"] == {"dp": dp, "tp": 2, "pp": 1}
    per_rank = [losses(events) for events in ranks]
    assert per_rank[0] == per_rank[1]  # a tp pair agrees
    if dp > 1:
        assert per_rank[2] == per_rank[3] and per_rank[0] != per_rank[2]  # halves differ
    mean = {s: sum(per_rank[2 * g][s] for g in range(dp)) / dp for s in per_rank[0]}
    assert_close(mean, reference, FP32_RTOL)
    # per-layer norms over a layer that holds sharded and plain parameters alike
    layers = next(e for e in ranks[0] if isinstance(e, LayerEvent))
    assert layers.layers[:2] == ["embed", "layers.0"]
    assert all(math.isfinite(g) and g > 0 for g in layers.grad_norm)


@pytest.mark.parametrize("sections", [
    {"precision": {"mode": "bf16"}, "compression": {"method": "int8"}},  # DDP's hook
    {"parallel": {"strategy": "fsdp"}, "precision": {"mode": "bf16"}},  # its GRUs sharded
], ids=["ddp-int8-bf16", "fsdp-bf16"])
def test_a_factory_model_runs_on_real_ranks(
        tmp_path: Path, user_models: str, sections: dict[str, dict[str, str]]) -> None:
    cfg = config(tmp_path / "out", batch=4, ranks=2, steps=6,
                 model={"factory": f"{user_models}:recurrent"},
                 telemetry={"per_layer": True}, **sections)
    events = run_ranks(tmp_path / "job", cfg, 2)
    steps = [[e for e in rank if isinstance(e, StepEvent)] for rank in events]
    assert [len(s) for s in steps] == [6, 6]
    assert all(torch.isfinite(torch.tensor(e.loss)) for e in steps[0])
    assert any(isinstance(e, LayerEvent) and "layers.1" in e.layers for e in events[0])
