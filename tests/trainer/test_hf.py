"""model.hf (issue 41): a Hugging Face causal LM by architecture and config, no module of the
user's. Every model here is built from a config (nothing is downloaded): a Llama-style one
inline, a GPT-2-style one from a config.json folder, and a saved trained one continued from
its safetensors."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from traind.contracts.events import StepEvent
from traind.daemon.admission import factory_params
from traind.daemon.config import ConfigError
from traind.daemon.experiments.specs import path_fields
from traind.errors import FieldErrors
from traind.trainer.config import ModelConfig, TrainConfig
from traind.trainer.factory import UserModel, build_user_model
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}


def _hf(cfg: TrainConfig, **hf: Any) -> TrainConfig:
    return TrainConfig.model_validate({**cfg.model_dump(mode="json"), "model": {
        **cfg.model.model_dump(mode="json"), "hf": hf}})


def _losses(cfg: TrainConfig) -> list[float]:
    sink = ListSink()
    assert train(cfg, sink).step == cfg.job.steps
    return [e.loss for e in sink.events if isinstance(e, StepEvent)]


def test_a_llama_from_inline_fields_trains(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    losses = _losses(_hf(make_config(tmp_path / "run", steps=30), config=LLAMA))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses


def test_a_gpt2_from_a_config_folder_trains(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**GPT2, "vocab_size": 50257}))
    cfg = _hf(make_config(tmp_path / "run", steps=30), path=str(folder))
    model = build_user_model(cfg.model)
    assert isinstance(model.inner, GPT2LMHeadModel)
    assert model.inner.config.vocab_size == 256  # traind's tokenizer's, not the file's
    losses = _losses(cfg)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses


def test_a_saved_model_goes_on_from_its_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items()
                                            if k != "model_type"}, vocab_size=256))
    with torch.no_grad():  # "trained": weights no fresh init would have
        for p in saved.parameters():
            p.add_(0.01 * torch.randn_like(p))
    saved.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    cfg = ModelConfig(vocab_size=256, seq_len=32,
                      hf={"path": tmp_path / "ckpt", "weights": True})
    loaded = build_user_model(cfg).eval()
    idx, targets = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    _, loss = loaded(idx, targets)
    _, want = UserModel(saved.eval())(idx, targets)
    assert loss is not None and want is not None and torch.equal(loss, want)
    fresh = build_user_model(cfg.model_copy(update={"hf": cfg.hf.model_copy(  # type: ignore
        update={"weights": False})})).eval()
    assert not torch.equal(fresh(idx, targets)[1], want)  # the weights made the difference


@pytest.mark.parametrize(("hf", "model", "loc", "says"), [
    ({"path": "nowhere"}, {}, ("model", "hf", "path"), "no such file"),
    ({"config": {"model_type": "no-such-arch"}}, {}, ("model", "hf", "config"),
     "cannot build"),
    ({"config": LLAMA}, {"seq_len": 128}, ("model", "seq_len"), "max_position_embeddings"),
])
def test_what_cannot_be_built_names_the_field(hf: dict[str, Any], model: dict[str, Any],
                                              loc: tuple[str, ...], says: str) -> None:
    with pytest.raises(FieldErrors) as err:
        build_user_model(ModelConfig(hf=hf, **model))
    assert err.value.errors[0][0] == loc and says in str(err.value)


def test_a_config_names_one_model_and_the_api_never_sets_one() -> None:
    with pytest.raises(ValueError, match="model_type is needed"):
        ModelConfig(hf={})
    with pytest.raises(ValueError, match="keep one"):
        ModelConfig(hf={"config": LLAMA}, factory="m:f")
    # a path and what transformers reads: the host owner's, never a web user's
    assert {"model.hf.path", "model.hf.config"} <= path_fields(TrainConfig)


def test_admission_measures_it_in_a_child_process() -> None:
    cfg = ModelConfig(hf={"config": LLAMA}, seq_len=32)
    assert factory_params(cfg) == build_user_model(cfg).num_params()
    with pytest.raises(ConfigError) as err:
        factory_params(ModelConfig(hf={"config": {"model_type": "no-such-arch"}}))
    assert "model.hf.config" in str(err.value)


def test_its_own_tensor_parallel_plan_is_refused_naming_the_field_for_now() -> None:
    """Issue 41.3 (not done): Hugging Face's plan styles are not mapped to PyTorch's yet, so a
    tp job on model.hf is refused, at model.hf, naming the style, never run wrong."""
    from traind.trainer.factory import count_params

    with pytest.raises(FieldErrors) as err:
        count_params(ModelConfig(hf={"config": LLAMA}, seq_len=32), tp=2)
    assert err.value.errors[0][0] == ("model", "hf") and "colwise" in str(err.value)


@pytest.mark.parametrize("sections", [
    {"precision": {"mode": "bf16"}, "compression": {"method": "int8"}},  # DDP's hook
    {"parallel": {"strategy": "fsdp"}, "precision": {"mode": "bf16"}},  # its layers sharded
    {"precision": {"mode": "fp8"}},  # torchao's emulation here
    {"precision": {"mode": "adaptive", "snr_window": 2}},
], ids=["ddp-int8-bf16", "fsdp-bf16", "fp8", "adaptive"])
def test_a_hugging_face_llama_runs_on_real_ranks(tmp_path: Path,
                                                 sections: dict[str, Any]) -> None:
    from tests.trainer.mesh_runs import config, run_ranks

    cfg = config(tmp_path / "out", batch=4, ranks=2, steps=6,
                 model={"hf": {"config": LLAMA}}, **sections)
    events = run_ranks(tmp_path / "job", cfg, 2)
    steps = [[e for e in rank if isinstance(e, StepEvent)] for rank in events]
    assert [len(s) for s in steps] == [6, 6]
    assert all(torch.isfinite(torch.tensor(e.loss)) for rank in steps for e in rank)


def test_fp8_finds_the_head_by_its_role_and_says_what_it_left() -> None:
    """Issue 41.4: fp8 converted Hugging Face's lm_head (the rule matched modules named
    "head"), and on GPT-2, whose blocks are Conv1D, the head was the only fp8 layer, silently.
    Now the head is the Linear that maps the token embedding's width to its vocabulary, and
    what stays bf16 is counted, by kind, in the started event's details."""
    from traind.trainer.config import PrecisionConfig
    from traind.trainer.precision import build_policy, output_heads

    cpu = torch.device("cpu")
    llama = build_user_model(ModelConfig(hf={"config": LLAMA}, seq_len=32))
    assert output_heads(llama) == {"inner.lm_head"}
    policy = build_policy(PrecisionConfig(mode="fp8"), cpu)
    policy.prepare(llama)
    details = policy.details()
    assert "inner.lm_head" not in details["fp8_layers"]
    assert len(details["fp8_layers"]) == 2 * 7  # q, k, v, o, gate, up, down per layer
    gpt2 = build_user_model(ModelConfig(hf={"config": GPT2}, seq_len=32))
    policy = build_policy(PrecisionConfig(mode="fp8"), cpu)
    policy.prepare(gpt2)
    details = policy.details()
    assert details["fp8_layers"] == [] and details["fp8_matmuls"] == 2 * 4 + 1
    assert details["fp8_left_out"] == {"Conv1D layers": 8,
                                       "Linear layers (the head, or too small to gain)": 1}


def test_adaptive_never_measures_the_embedding_whatever_its_name() -> None:
    """Issue 41.4: adaptive measured and switched a factory model's ``embed_tokens`` (it
    pinned only a group named "embed"). The embedding is found by its type now."""
    from traind.trainer.config import PrecisionConfig
    from traind.trainer.precision import AdaptivePolicy, build_policy

    policy = build_policy(PrecisionConfig(mode="adaptive"), torch.device("cpu"))
    assert isinstance(policy, AdaptivePolicy)
    policy.prepare(build_user_model(ModelConfig(hf={"config": LLAMA}, seq_len=32)))
    assert "model.embed_tokens" not in policy._measured
    assert {"model.layers.0", "model.layers.1", "lm_head"} <= set(policy._measured)
