"""What a job will need, from its config alone (no torch): parameters, and a conservative
estimate of the memory a rank holds, so the daemon can refuse a job that cannot fit before it
launches it (rather than the OOM killer deciding a minute later).

The parameter count is a twin of ``GPT.num_params`` (tests hold them equal); the memory
estimate is an upper-bound sketch, not a profile: fp32 weights, gradients and AdamW's two
moments (16 bytes a parameter), plus the activations autograd keeps for one micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traind.trainer.config import ModelConfig, TrainConfig

OPTIMIZER_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg and exp_avg_sq


def mlp_hidden_width(cfg: ModelConfig) -> int:
    """SwiGLU hidden width: ``cfg.mlp_hidden`` or 8/3·d_model rounded up to a multiple of 32.

    8/3 keeps the three SwiGLU matrices at the parameter count of a 4x GELU MLP's two
    (PaLM, Llama); a multiple of 32 keeps matmuls on friendly tile sizes.
    """
    if cfg.mlp_hidden:
        return cfg.mlp_hidden
    return 32 * math.ceil(8 * cfg.d_model / 3 / 32)


def param_count(cfg: ModelConfig) -> int:
    d, h, v = cfg.d_model, mlp_hidden_width(cfg), cfg.vocab_size
    kv = cfg.kv_heads * (d // cfg.n_heads)  # k's and v's width: d for multi-head attention
    # q + proj, k + v; gate, up + down; two RMSNorm weights
    block = 2 * d * d + 2 * d * kv + 3 * d * h + 2 * d
    tables = 1 if cfg.tie_embeddings else 2  # the embedding, and the head unless tied to it
    return cfg.n_layers * block + tables * v * d + d  # + the final norm


@dataclass(frozen=True, slots=True)
class Footprint:
    params: int
    weights_bytes: int      # weights, gradients, optimizer state (per rank, unsharded)
    activations_bytes: int  # kept for backward, one micro-batch (per rank)

    @property
    def bytes_per_rank(self) -> int:
        return self.weights_bytes + self.activations_bytes


def footprint(cfg: TrainConfig, *, params: int | None = None) -> Footprint:
    """``params``: a factory model's count, measured (``trainer/factory.count_params``); its
    activations depend on shapes traind cannot read, so they are not estimated (0): the
    estimate is then a lower bound, weights, gradients and optimizer state only."""
    m, b = cfg.model, cfg.job.batch_size
    if m.user_field is not None:
        if params is None:
            raise ValueError("a factory model's footprint needs its measured parameter count")
        return Footprint(params=params, weights_bytes=OPTIMIZER_BYTES_PER_PARAM * params,
                         activations_bytes=0)
    d, t, layers = m.d_model, m.seq_len, m.n_layers
    params = param_count(m)
    # Per block and token, autograd keeps about 16 d-wide tensors (norms, qkv, attention out,
    # the SwiGLU's 2h gate/up and its product) plus, for full attention, the (T, T) scores and
    # probabilities per head; 4 bytes each (fp32: an upper bound for bf16 too).
    per_token = 16 * d + 3 * mlp_hidden_width(m)
    scores = 2 * m.n_heads * t * t if m.attention == "full" else 0
    activations = 4 * b * layers * (t * per_token + scores) + 4 * b * t * m.vocab_size * 2
    if m.activation_checkpointing:
        activations = 4 * b * (layers * t * d + t * per_token + scores + 2 * t * m.vocab_size)
    return Footprint(params=params, weights_bytes=OPTIMIZER_BYTES_PER_PARAM * params,
                     activations_bytes=activations)
