"""Causal attention, full or a sliding window with attention sinks, behind one ``attend``.

The rule is one pure function, ``allowed``: a query at position q sees key kv when kv is not in
the future, and it is either one of the ``window`` most recent positions (q itself included) or
one of the first ``global_tokens`` positions (the "attention sinks" of StreamingLLM, which keep
the softmax a place to put mass that the window has dropped).

Four implementations of that rule:

- ``naive_attention``: softmax(QK^T/sqrt(d) + mask) V written out in fp32. Slow and O(T^2)
  memory, but obviously right: it is the oracle the tests hold the others to.
- ``sdpa_mask_attention``: ``scaled_dot_product_attention`` with a boolean ``attn_mask``. Runs
  anywhere, with autograd and dropout; the only candidate off CUDA (see below).
- ``flex_attention_sliding``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` from
  ``create_block_mask``, so the kernel skips the key blocks the window leaves out entirely.
  Compiled into a fused Triton kernel on CUDA.
- ``kernels.swa.sliding_window_attention`` (backend ``triton``): a hand-written
  FlashAttention-style Triton kernel with its backward, honouring TF32 for fp32 inputs; off
  CUDA it runs its twin, which is SDPA with the mask.

Which of the last three runs is ``cfg.attention_backend``; its default, ``auto``, is measured
at the first call of each shape and cached (``auto_backend``, trainer/attention_choice.py), and
``bench/attention.py`` prints the same measurements as a table.

Measured on this project's CPU machine (2 cores shared with other jobs, load ~9, so only the
ratios mean much; torch 2.13.0+cpu, B=4, nh=4, hs=32, window=64, global_tokens=4, forward only,
ms per call, two runs):

    T     flex (eager)   SDPA + bool mask   SDPA is_causal   create_block_mask
    128   273 / 457      16 / 35            32 / 34          5 / 5
    256   497 / 411      62 / 60            41 / 37          36 / 46
    512   881 / 837      148 / 89           70 / 69          250 / 98

Eager flex on CPU runs a dense reference path (it materialises the scores and evaluates the
mask_mod over every (q, kv) pair), so it is 6-17x slower than SDPA with a mask. It also refuses
backward on CPU ("FlexAttention does not support backward on CPU"), and compiling it for the CPU
took 20-100 s on first call before reaching ~33-53 ms (torch 2.13: 30 s for the first shape,
7 s for each further one, then 0.9-2.7x SDPA-with-mask's forward; its backward still raises,
compiled or not). So off CUDA SDPA with a mask is the only candidate; flex is a CUDA one.
Building a BlockMask costs as much as an attention call, so masks (of both kinds) are cached
per shape and device rather than rebuilt every forward.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from traind.kernels import _dispatch as kernel_dispatch
from traind.kernels.swa import cuda_fp32_matmul_precision, sliding_window_attention
from traind.trainer.attention_choice import BackendChoice, ChoiceKey, candidates

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.attention_choice import Name
    from traind.trainer.config import AttentionBackend as Backend
    from traind.trainer.config import ModelConfig

# Feature detection: flex_attention arrived in torch 2.5 and is a prototype API; anything that
# fails to import leaves the SDPA path, which every torch we support has.
try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    HAS_FLEX = False
else:
    HAS_FLEX = True


def allowed(
    q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int, global_tokens: int
) -> torch.Tensor:
    """Whether query position ``q_idx`` may attend to key position ``kv_idx`` (broadcasting).

    Written with tensor ops only (no ``if`` on values), because ``create_block_mask`` traces it
    under vmap as a ``mask_mod``.
    """
    causal = q_idx >= kv_idx
    return causal & ((q_idx - kv_idx < window) | (kv_idx < global_tokens))


def mask_matrix(
    T: int, window: int, global_tokens: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ``(T, T)`` boolean mask, True where query row q may see key column kv."""
    idx = torch.arange(T, device=device)
    return allowed(idx[:, None], idx[None, :], window, global_tokens)  # (T, T)


# A model uses one (T, window, global_tokens) in training and maybe one more in evaluation, so
# a handful of entries covers it; the bound keeps a long-lived process with many shapes flat.
@functools.lru_cache(maxsize=16)
def _cached_mask(T: int, window: int, global_tokens: int, device: torch.device) -> torch.Tensor:
    return mask_matrix(T, window, global_tokens, device)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The oracle: explicit softmax(QK^T / sqrt(hs), masked) V, computed in fp32.

    q, k, v: (B, nh, T, hs); mask: (T, T) bool, True = may attend. Every row must allow at least
    its own position (``allowed`` always does), or the softmax of an all ``-inf`` row is NaN.
    """
    scale = 1.0 / math.sqrt(q.size(-1))
    scores = q.float() @ k.float().transpose(-2, -1) * scale  # (B, nh, T, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)  # (B, nh, T, hs)


def sdpa_mask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    global_tokens: int,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Sliding-window attention through SDPA with a boolean mask; q, k, v: (B, nh, T, hs)."""
    mask = _cached_mask(q.size(-2), window, global_tokens, q.device)  # (T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


@functools.lru_cache(maxsize=16)
def _cached_block_mask(T: int, window: int, global_tokens: int, device: torch.device) -> BlockMask:
    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return allowed(q_idx, kv_idx, window, global_tokens)

    # B=None, H=None: the rule is the same for every sequence and head, so one mask broadcasts.
    return create_block_mask(mask_mod, None, None, T, T, device=device)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    # Created on first use, not at import: torch.compile is lazy anyway, but this keeps importing
    # the model free of compiler state. Eager flex is a slow dense reference path; compiled, it
    # becomes the fused block-sparse kernel that is the reason to use flex at all.
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_sliding(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, global_tokens: int
) -> torch.Tensor:
    """Sliding-window attention through flex_attention; q, k, v: (B, nh, T, hs).

    Compiled on CUDA; eager elsewhere (it is then a correctness path for tests, forward only on
    CPU, since flex has no CPU backward).
    """
    if not HAS_FLEX:
        raise RuntimeError("flex_attention is not available in this torch build")
    block_mask = _cached_block_mask(q.size(-2), window, global_tokens, q.device)
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=block_mask)  # (B, nh, T, hs)
    out = flex_attention(q, k, v, block_mask=block_mask)  # (B, nh, T, hs)
    assert isinstance(out, torch.Tensor)  # it returns a tuple only when asked for aux outputs
    return out


# The process-wide cache of measured choices ("auto"); trainer/attention_choice.py says how.
CHOICE = BackendChoice()


def _triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
            global_tokens: int) -> torch.Tensor:
    return sliding_window_attention(q, k, v, window=window, global_tokens=global_tokens)


# Each implementation of the sliding window by name, as attention_choice names them.
IMPLEMENTATIONS: dict[Name, Callable[..., torch.Tensor]] = {
    "sdpa_mask": sdpa_mask_attention,
    "triton": _triton,
    "flex": flex_attention_sliding,
}


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def backend_trial(name: Name, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  window: int, global_tokens: int, grad: bool) -> Callable[[], object]:
    """One call of ``name`` (forward, and backward when ``grad``) on copies of q, k, v."""
    # Copies, not fresh random tensors: the values are realistic, and the RNG stream the
    # training draws from is left untouched.
    leaves = [x.detach().clone().requires_grad_(grad) for x in (q, k, v)]
    run = IMPLEMENTATIONS[name]

    def once() -> object:
        # Identity saved-tensor hooks on top of the stack: an activation checkpoint or offload
        # around this call must not capture (nor later recompute) what the trial saves.
        with torch.autograd.graph.saved_tensors_hooks(_same, _same), torch.set_grad_enabled(
                grad):
            out = run(*leaves, window=window, global_tokens=global_tokens)
            if grad:
                torch.autograd.grad(out, leaves, leaves[0].detach())
        return out

    return once


def auto_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
                 global_tokens: int, dropout_p: float) -> Name:
    """The sliding-window implementation ``auto`` runs for this call: measured at the first
    call of each shape (see trainer/attention_choice.py), then cached."""
    names = candidates(device_type=q.device.type, has_triton=kernel_dispatch.use_triton(q),
                       has_flex=HAS_FLEX, dropout=dropout_p > 0.0)
    if len(names) == 1:  # every CPU call: nothing to choose, no key to build
        return names[0]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    precision = cuda_fp32_matmul_precision() if q.dtype == torch.float32 else ""
    key = ChoiceKey(str(q.device), q.dtype, tuple(q.shape), window, global_tokens, grad,
                    precision)
    return CHOICE.choose(key, names, lambda name: backend_trial(
        name, q, k, v, window=window, global_tokens=global_tokens, grad=grad))


def choose_ahead(cfg: ModelConfig, shape: tuple[int, int, int, int], device: torch.device,
                 dtype: torch.dtype, *, grad: bool = True) -> Name | None:
    """Measure ``auto``'s choice for q, k, v of ``shape`` (B, nh, T, hs) now, eagerly.

    For a model about to be compiled: inside the trace nothing is timed, so without this its
    first (traced) call takes ``static_choice``. None where auto needs no choice (full
    attention, a window covering T, or a backend forced by the config).
    """
    if cfg.attention == "full" or cfg.attention_backend != "auto" or cfg.window >= shape[2]:
        return None
    # a private generator: the training's RNG stream stays as it was
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_(grad)
               for _ in range(3))
    with torch.set_grad_enabled(grad):
        return auto_backend(q, k, v, window=cfg.window, global_tokens=cfg.global_tokens,
                            dropout_p=cfg.dropout if grad else 0.0)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cfg: ModelConfig,
    dropout_p: float = 0.0,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Causal attention as ``cfg.attention`` asks; q, k, v, result: (B, nh, T, hs).

    ``backend`` (default ``cfg.attention_backend``) forces an implementation of the sliding
    window (tests use it to check each); ``auto`` lets ``auto_backend`` measure which is
    fastest here. Full attention, and a window that covers the sequence, always run SDPA
    with ``is_causal``.
    """
    T = q.size(-2)
    backend = cfg.attention_backend if backend is None else backend
    # A window that covers the whole sequence is plain causal attention (every allowed() term
    # past causality is true), so it takes the fused is_causal kernel and needs no mask.
    if cfg.attention == "full" or (backend == "auto" and cfg.window >= T):
        # is_causal lets the fused kernels skip the masked half instead of reading a (T, T) mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if backend == "auto":
        backend = auto_backend(q, k, v, window=cfg.window, global_tokens=cfg.global_tokens,
                               dropout_p=dropout_p)
    if dropout_p and backend != "sdpa_mask":
        # neither the kernel nor flex_attention has dropout
        raise ValueError(f"attention_backend {backend!r} has no dropout; use 'sdpa_mask'")
    extra = {"dropout_p": dropout_p} if dropout_p else {}
    return IMPLEMENTATIONS[backend](q, k, v, window=cfg.window,
                                    global_tokens=cfg.global_tokens, **extra)
