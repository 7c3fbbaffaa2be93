"""Model presets (trainer/presets.py): each builds, its size is near its name, and a field
set explicitly wins over the preset's."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from traind.trainer.config import ModelConfig, TrainConfig
from traind.trainer.footprint import param_count
from traind.trainer.model import GPT
from traind.trainer.presets import (
    NOMINAL,
    PRESETS,
    REFERENCE_VOCAB,
    SHAPE_FIELDS,
    PresetName,
)


def test_every_preset_has_a_nominal_size_and_only_shape_fields() -> None:
    assert NOMINAL.keys() == PRESETS.keys()
    assert set(PRESETS) | {"custom"} == set(get_args(PresetName))
    for shape in PRESETS.values():
        assert tuple(shape) == SHAPE_FIELDS


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_size_is_near_its_name(name: str) -> None:
    """Built on the meta device (no memory, no init): the count at the vocabulary the names
    count at (REFERENCE_VOCAB, untied), within 25% of the name, and the config-only twin
    (trainer/footprint.py) agrees to the parameter."""
    cfg = ModelConfig(preset=name, vocab_size=REFERENCE_VOCAB, seq_len=2048)
    with torch.device("meta"):
        model = GPT(cfg)
    n = model.num_params()
    assert n == param_count(cfg)
    if (nominal := NOMINAL[name]) is not None:
        assert abs(n - nominal) <= 0.25 * nominal, f"{name}: {n / 1e6:.1f}M"
    # tying drops exactly one table
    tied = cfg.model_copy(update={"tie_embeddings": True})
    assert param_count(tied) == n - REFERENCE_VOCAB * cfg.d_model


def test_preset_fills_the_shape_fields() -> None:
    cfg = ModelConfig(preset="1b")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_hidden) == (
        2048, 16, 32, 8, 8192)
    assert cfg.kv_heads == 8
    # never the run's own choices
    default = ModelConfig()
    assert (cfg.vocab_size, cfg.seq_len, cfg.rope_theta, cfg.tie_embeddings) == (
        default.vocab_size, default.seq_len, default.rope_theta, default.tie_embeddings)


def test_explicit_fields_win_over_the_preset() -> None:
    cfg = ModelConfig(preset="125m", n_layers=2, mlp_hidden=0)
    assert (cfg.n_layers, cfg.mlp_hidden) == (2, 0)
    assert (cfg.d_model, cfg.n_heads) == (768, 12)  # the rest from the preset
    # and through the whole tree, as a TOML file or an API body gives it
    tree = TrainConfig.model_validate({"model": {"preset": "debug", "n_kv_heads": 4}})
    assert (tree.model.d_model, tree.model.n_heads, tree.model.n_kv_heads) == (256, 16, 4)


def test_custom_is_the_fields_as_given() -> None:
    assert ModelConfig(preset="custom") == ModelConfig()


def test_a_preset_config_round_trips() -> None:
    """A stored config (JSON) validates back to itself: every filled field is explicit then."""
    cfg = ModelConfig(preset="350m", n_layers=3)
    assert ModelConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_unknown_preset_names_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        ModelConfig(preset="7b")  # type: ignore[arg-type]
    assert exc.value.errors()[0]["loc"] == ("preset",)


def test_debug_is_torchtitans_debugmodel_shape() -> None:
    """Issue 41: the preset said torchtitan's debugmodel and had 8 layers; torchtitan 0.3's
    has 6. Its parameters, counted from torchtitan's own config (dim 256, 16 heads, ffn
    hidden from multiple_of=256, vocab 2048, an untied lm_head, RMSNorm weights):"""
    dim, layers, vocab = 256, 6, 2048
    hidden = 256 * -(-int(2 * 4 * dim / 3) // 256)  # torchtitan's compute_ffn_hidden_dim
    per_layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim  # wqkv+wo, w1..w3, two norms
    torchtitan = 2 * vocab * dim + layers * per_layer + dim
    assert torchtitan == 6_163_712  # the count the issue measured of torchtitan 0.3.0
    cfg = ModelConfig(preset="debug", vocab_size=vocab)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp_hidden) == (dim, layers, 16, hidden)
    assert GPT(cfg).num_params() == torchtitan


def test_debug_preset_trains_a_step() -> None:
    cfg = ModelConfig(preset="debug", n_layers=2, seq_len=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    assert loss is not None
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
