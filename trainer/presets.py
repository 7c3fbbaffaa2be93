"""Model presets: named shapes of the Llama-style ``GPT`` (``model.preset``).

A preset fills the *shape* fields of ``ModelConfig`` (d_model, n_layers, n_heads, n_kv_heads,
mlp_hidden) that the config leaves out; a field set explicitly wins. It never sets
``vocab_size`` (the tokenizer's), ``seq_len`` (the data's and the memory's), ``rope_theta`` or
``tie_embeddings``: those are choices of the run, not of the model's size.

The shapes are the ones the field compares against:

- ``debug``: the shape of torchtitan's llama3 ``debugmodel`` (dim 256, 6 layers, 16 heads,
  hidden 768; 6 layers since torchtitan 0.3, 8 before), a model that builds and steps in
  seconds anywhere; its size is mostly its vocabulary's. At torchtitan's vocabulary (2048)
  both have 6,163,712 parameters. The same shape, not the same function: torchtitan's RoPE
  has base 500,000 with Llama 3.1's frequency scaling, traind's is ``rope_theta`` (a choice
  of the run, as above) without scaling.
- ``60m``, ``350m``: the Llama shapes of the GaLore / ReLoRA baselines (llama_60m, llama_350m)
  at Llama 2's 32000-token vocabulary; hidden widths rounded up to a multiple of 256 as
  torchtitan's ``multiple_of`` does.
- ``125m``: GPT-2 small's shape (768 wide, 12 layers, 12 heads) with a SwiGLU of 8/3 width.
- ``1b``: Llama 3.2 1B's shape (2048 wide, 16 layers, 32 heads, 8 kv heads, hidden 8192).

Each name is the parameter count at ``REFERENCE_VOCAB`` (32000) with an untied head, the
default; tests/trainer/test_presets.py holds every preset within 25% of it. A different
vocabulary moves the count by ``2 * vocab * d_model`` (one table when tied), which for the
small presets is most of it: at a 256-byte vocabulary ``60m`` has 28M parameters.
"""

from __future__ import annotations

from typing import Literal

PresetName = Literal["custom", "debug", "60m", "125m", "350m", "1b"]

REFERENCE_VOCAB = 32000  # the vocabulary each preset's name counts at (Llama 2's)

# The fields a preset fills (tests/trainer/test_presets.py holds every preset to them).
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden")

PRESETS: dict[str, dict[str, int]] = {
    "debug": {"d_model": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16,
              "mlp_hidden": 768},
    "60m": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "mlp_hidden": 1536},
    "125m": {"d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12,
             "mlp_hidden": 2048},
    "350m": {"d_model": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 16,
             "mlp_hidden": 2816},
    "1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "mlp_hidden": 8192},
}

# The parameter count each name stands for (None: a name that promises no size).
NOMINAL: dict[str, int | None] = {"debug": None, "60m": 60_000_000, "125m": 125_000_000,
                                  "350m": 350_000_000, "1b": 1_000_000_000}


def fill_preset(data: dict[str, object]) -> dict[str, object]:
    """``data`` (a model node's raw keys) with its preset's shape fields filled in where it
    has none of its own; unchanged for ``custom`` or no preset. An unknown name is left for
    the field's own validation to reject."""
    shape = PRESETS.get(str(data.get("preset", "custom")))
    if shape is None:
        return data
    return {**{k: v for k, v in shape.items() if k not in data}, **data}
