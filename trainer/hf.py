"""``model.hf``: a Hugging Face causal LM by architecture and config, with no module of the
user's.

The config is a local ``config.json`` (``model.hf.path``: the file, or a folder holding it) and
fields inline (``model.hf.config``, over the file's); ``model_type`` picks transformers' class
(``AutoModelForCausalLM``). The vocabulary is traind's tokenizer's (``model.vocab_size``), so
the model's embedding and head are sized to the data it trains on. ``model.hf.weights`` loads
the folder's safetensors, a trained model to go on from: their vocabulary must then be
traind's. Nothing is downloaded (only local files are read, and no remote code runs), and
every path comes from the config file or the CLI (the API refuses ``model.hf``:
daemon/experiments/specs.py). The built module is driven like any user model
(trainer/factory.UserModel: its forward called by name, its ``.logits`` read).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from traind.errors import FieldErrors
from traind.extras import MissingExtra, require
from traind.trainer.fp8_support import quiet_torchao_import

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from traind.trainer.config import ModelConfig

_LOC = ("model", "hf")
# A config's longest context under the names transformers' architectures use.
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")


def build_hf(cfg: ModelConfig) -> nn.Module:
    """The causal LM ``cfg.hf`` names; ``FieldErrors`` at the field that is wrong."""
    hf = cfg.hf
    assert hf is not None
    try:
        with quiet_torchao_import():  # transformers imports torchao where it is installed
            transformers = require("transformers")
    except MissingExtra as exc:
        raise FieldErrors.at(_LOC, str(exc)) from None
    AutoConfig, AutoModelForCausalLM = (
        transformers.AutoConfig, transformers.AutoModelForCausalLM)
    folder, base = _read_config(hf.path) if hf.path is not None else (None, {})
    fields: dict[str, Any] = {**base, **hf.config}
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise FieldErrors.at((*_LOC, "config"), "model_type is needed (e.g. 'llama', 'gpt2', "
                             "'qwen2'): in config.json or inline")
    for key in ("auto_map", "trust_remote_code"):  # no remote code, ever
        fields.pop(key, None)
    saved_vocab = fields.get("vocab_size")
    fields["vocab_size"] = cfg.vocab_size
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as exc:
        raise FieldErrors.at((*_LOC, "config"), f"transformers cannot build a "
                             f"{model_type!r} config: {exc}") from None
    for name in _POSITIONS:
        most = getattr(config, name, None)
        if isinstance(most, int) and most < cfg.seq_len:
            raise FieldErrors.at(("model", "seq_len"), f"{cfg.seq_len} is longer than the "
                                 f"model's {name} ({most})")
    try:
        with quiet_torchao_import():
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # a model_type that is not a causal LM
        raise FieldErrors.at((*_LOC, "config"), str(exc).splitlines()[0]) from None
    if hf.weights:
        assert folder is not None  # HFConfig refuses weights without a path
        if saved_vocab is not None and saved_vocab != cfg.vocab_size:
            raise FieldErrors.at(("model", "vocab_size"), f"{cfg.vocab_size}, but the "
                                 f"weights in {folder} are for a vocabulary of {saved_vocab}")
        if not any(p.is_meta for p in model.parameters()):  # admission's count needs none
            _load_weights(model, folder)
    return model


def _read_config(path: Path) -> tuple[Path, dict[str, Any]]:
    """The folder of ``path``'s config and its fields."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FieldErrors.at((*_LOC, "path"), f"{file}: no such file")
    try:
        fields = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FieldErrors.at((*_LOC, "path"), f"{file}: not a JSON config ({exc})") from None
    if not isinstance(fields, dict):
        raise FieldErrors.at((*_LOC, "path"), f"{file}: not a JSON object")
    return file.parent, fields


def _load_weights(model: nn.Module, folder: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FieldErrors.at((*_LOC, "weights"), f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A head tied to the embedding is saved once: its key is missing by design.
    tied = {k for k in missing if k.endswith("lm_head.weight")
            and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        wrong = sorted(set(missing) - tied)[:3] + sorted(unexpected)[:3]
        raise FieldErrors.at((*_LOC, "weights"), f"the weights in {folder} do not fit the "
                             f"model: {', '.join(wrong)}")
