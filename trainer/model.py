"""A Llama-style decoder: pre-norm blocks, RoPE, causal (grouped-query) attention, SwiGLU.

Read top to bottom like nanoGPT's ``model.py``; the differences are the modern defaults that
Llama-family models use (RMSNorm, rotary positions, SwiGLU, no biases, and grouped-query
attention: ``model.n_kv_heads`` key/value heads, each shared by a group of query heads).
``model.preset`` names a size of it (trainer/presets.py).

The output head is *untied* from the token embedding by default. With a 256-byte vocabulary
tying would save only ``256 * d_model`` parameters, while separate weights keep every parameter
owned by exactly one module, which is what tensor and pipeline parallel (the embedding and the
head are sharded as two modules, or live on different stages) and per-module precision policies
want; it is also torchtitan's Llama choice. ``model.tie_embeddings`` ties them (GPT-2's and Llama
3.2 1B's choice, worth it at a large vocabulary and a small width): ``head.weight`` *is*
``tok_emb.weight``, one Parameter.

Attention is full causal or a sliding window (``trainer/attention.py`` holds the rule and its
implementations). Memory savers are opt-in per config: activation checkpointing recomputes each
block in backward, activation offload parks saved tensors in host memory. Both act on the block
*call*, not the module tree, so ``model.blocks`` stays a plain ModuleList of ``Block`` and FSDP2's
``fully_shard`` can still be applied per block.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from traind.kernels.rmsnorm import RMSNorm
from traind.trainer.attention import attend
from traind.trainer.footprint import mlp_hidden_width

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.config import ModelConfig


def rope_cache(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings, each ``(seq_len, head_dim // 2)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first-half, second-half) channel pair of ``x`` by its position's angle.

    x: (B, nh, T, hs); cos, sin: (T, hs/2). The "rotate half" layout (as in Llama's HF port)
    needs no interleaving, so it is two slices and a cat.
    """
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention. q, k and v are separate
    projections (torchtitan's wq/wk/wv) rather than one fused matmul: tensor parallel shards
    each by output rows, so a rank holds whole heads of all three; a fused weight would split
    across the q/k/v boundary instead. The head counts in forward are read off the
    projections' outputs, so the same code runs with all heads (one rank) or a tp rank's share
    of them (n_heads / tp query heads, n_kv_heads / tp kv heads: a rank's query heads are
    exactly the groups of its kv heads, as the grouping below is contiguous)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        kv_width = cfg.kv_heads * self.head_dim  # d_model for multi-head attention
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.v = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj.is_residual_proj = True  # type: ignore[assignment]  # scaled init, see GPT
        self._register_load_state_dict_pre_hook(_split_fused("qkv", ("q", "k", "v")))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]  # (B, T, C)
        hs = self.head_dim
        # nh, nkv below are this rank's heads: all of them, or n_heads / tp and
        # n_kv_heads / tp under tensor parallel
        q = self.q(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if (group := q.size(1) // k.size(1)) > 1:
            # query head i reads kv head i // group (Llama's grouping). A copy, but one that
            # every attention backend takes (SDPA's enable_gqa would spare it for full
            # attention only, and not on every device or torch); rope ran on nkv heads first.
            k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        # full: SDPA with is_causal; sliding_window: the Triton kernel, compiled flex or SDPA
        # with a mask, as model.attention_backend says (auto: measured per shape, attend())
        y = attend(
            q, k, v, cfg=self.cfg, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh * hs)
        return self.proj(y)  # (B, T, C)


class SwiGLU(nn.Module):
    """silu(gate(x)) * up(x), projected back down. gate and up are separate Linears for the
    reason q/k/v are: a tp rank's rows of each must pair up (torchtitan's w1/w3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = mlp_hidden_width(cfg)
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)
        self.down.is_residual_proj = True  # type: ignore[assignment]
        self._register_load_state_dict_pre_hook(_split_fused("gate_up", ("gate", "up")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, H) inside, (B, T, C) out


def _split_fused(fused: str, parts: tuple[str, ...]) -> Callable[..., None]:
    """A load_state_dict pre-hook reading checkpoints written before the projections were
    split: ``<prefix><fused>.weight`` becomes one weight per part, in order (the fused
    module's output rows were ``parts`` stacked)."""

    def hook(state: dict[str, Any], prefix: str, *_: Any) -> None:
        key = f"{prefix}{fused}.weight"
        if key in state:
            chunks = state.pop(key).chunk(len(parts), dim=0)
            state.update({f"{prefix}{p}.weight": c for p, c in zip(parts, chunks, strict=True)})

    return hook


class Block(nn.Module):
    """Pre-norm block: the residual stream is never normalised, only each branch's input.

    ``RMSNorm`` is ``nn.RMSNorm`` with a fused Triton kernel on CUDA (kernels/rmsnorm.py)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # one Parameter under two names: parameters() yields it once (the optimizer's
            # one entry), state_dict() holds both keys, so either kind of checkpoint loads
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_cache(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        # non-persistent: derived from the config, so not worth a place in checkpoints
        self.register_buffer("rope_cos", cos, persistent=False)  # (T, hs/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (T, hs/2)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # nanoGPT / GPT-2: N(0, 0.02) everywhere, and the projections that write into the
        # residual stream scaled by 1/sqrt(2·n_layers) so its variance does not grow with depth.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_proj", False):
                std /= math.sqrt(2 * self.cfg.n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, vocab)`` for byte ids ``idx`` ``(B, T)``, and the mean cross-entropy
        against ``targets`` ``(B, T)`` when given."""
        b, t = idx.shape  # lower case: ruff takes upper-case names for constants in comparisons
        if t > self.cfg.seq_len:  # the RoPE tables end there
            raise ValueError(f"sequence of {t} tokens is longer than model.seq_len "
                             f"({self.cfg.seq_len})")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # (T, hs/2)
        x = self.tok_emb(idx)  # (B, T, C)
        # Only when autograd will run backward: under no_grad nothing is saved, so there is
        # nothing to recompute or offload, and checkpoint would only add overhead.
        x = run_blocks(list(self.blocks), x, cos, sin, self.cfg,
                       saving=self.training and torch.is_grad_enabled())
        logits = self.head(self.norm(x))  # (B, T, V)
        loss = None
        if targets is not None:
            # in fp32 even under bf16 autocast: log-softmax over the vocab needs the range
            loss = F.cross_entropy(logits.float().view(b * t, -1), targets.reshape(b * t))
        return logits, loss

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count, a tied weight once; ``non_embedding`` leaves out the token table
        (a lookup, no FLOPs) unless it is also the head, whose matmul it then does."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.head.weight is not self.tok_emb.weight:
            n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls forward and backward, plus attention's
        QK^T and AV products, 12·L·d_model per key attended (PaLM appendix B).

        The attention counted is the attention that runs (:func:`attended_keys`): a causal
        query sees (T + 1) / 2 keys on average, and a sliding window fewer. PaLM and nanoGPT
        count all T keys per query, which makes an MFU look better than the work done: at
        this model's shapes up to twice the attention, and far more for a sliding window.
        """
        c = self.cfg
        return round(6 * self.num_params(non_embedding=True)
                     + 12 * c.n_layers * c.d_model * attended_keys(c))


def attended_keys(cfg: ModelConfig) -> float:
    """Keys one query attends to, on average over a full sequence of ``seq_len``: causal
    attention, (T + 1) / 2; a sliding window, each query's last ``window`` positions (itself
    included) and, before those, any of the first ``global_tokens`` (trainer/attention.py's
    mask)."""
    t, w, g = cfg.seq_len, cfg.window, cfg.global_tokens
    if cfg.attention == "full" or w >= t:
        return (t + 1) / 2
    # query i (0-based) sees min(i + 1, w) recent keys and max(0, min(g, i + 1 - w)) sinks
    recent = w * (w + 1) / 2 + (t - w) * w
    sinks = sum(min(g, i + 1 - w) for i in range(w, t)) if g else 0
    return (recent + sinks) / t


def run_blocks(blocks: list[nn.Module], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cfg: ModelConfig, *, saving: bool) -> torch.Tensor:
    """``x`` ``(B, T, C)`` through ``blocks`` in order, with the memory savers ``cfg`` asks for
    when autograd will save tensors (``saving``): the whole model's blocks, or a pipeline
    stage's (trainer/pipeline_parallel.py)."""
    recompute = saving and cfg.activation_checkpointing
    offload = saving and cfg.activation_offload
    # save_on_cpu moves every tensor autograd saves in the blocks to host memory in forward
    # and back in backward. Pinned memory lets those copies run asynchronously, and exists
    # only for CUDA tensors' sake; on the CPU the hooks hand back the tensor itself.
    with (
        torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
        if offload
        else contextlib.nullcontext()
    ):
        for block in blocks:
            if recompute:
                # non-reentrant: works when inputs need no grad, with autograd hooks
                # (FSDP2's) and nested saved-tensor hooks (the offload above), and is the
                # variant torch recommends; the block keeps its inputs and recomputes the rest.
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
    return x


def layer_groups(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The model's layers as telemetry and adaptive precision see them: "embed",
    "block.0".."block.N-1", "head" (the final norm with the head it feeds). Pass the
    unwrapped model (not DDP's wrapper). With tied embeddings the one weight is in both
    "embed" and "head". A factory's model (trainer/factory.UserModel) names its own."""
    if callable(own := getattr(model, "layer_groups", None)):
        return own()
    groups: dict[str, list[nn.Module]] = {"embed": [_submodule(model, "tok_emb")]}
    for i, block in enumerate(_submodule(model, "blocks").children()):
        groups[f"block.{i}"] = [block]
    groups["head"] = [_submodule(model, "norm"), _submodule(model, "head")]
    return groups


def _submodule(model: nn.Module, attr: str) -> nn.Module:
    module = getattr(model, attr, None)
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a GPT-like model with .{attr}; {type(model).__name__} has "
                        "none (pass the model, not its DDP wrapper)")
    return module
