"""Sliding-window causal attention with global tokens, forward and backward (FlashAttention
style: online softmax over the key blocks inside the window plus the global columns).

The rule is trainer/attention.py's ``allowed``: query q sees key kv when ``kv <= q`` and either
``q - kv < window`` or ``kv < global_tokens``. The twin is what ``attend`` runs off CUDA:
``scaled_dot_product_attention`` with that rule as a boolean mask. The kernel never builds the
(T, T) matrix and skips the key blocks the window leaves out, so its work grows with
T · (window + global_tokens), not T².

fp32 inputs run the kernel's matmuls in TF32 exactly when torch allows TF32 for CUDA matmuls
(``dot_precision``), as cuBLAS and SDPA do, so switching TF32 on speeds this kernel up too.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from traind.kernels import _dispatch


def mask_matrix(T: int, window: int, global_tokens: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True where query row q may see key column kv."""
    idx = torch.arange(T, device=device)
    q_i, kv_i = idx[:, None], idx[None, :]
    return (q_i >= kv_i) & ((q_i - kv_i < window) | (kv_i < global_tokens))


DotPrecision = Literal["tf32", "ieee"]


def dot_precision(dtype: torch.dtype, fp32_matmul_precision: str) -> DotPrecision:
    """The kernel's ``tl.dot`` input precision for inputs of ``dtype``.

    ``fp32_matmul_precision`` is torch's setting for CUDA fp32 matmuls (``"tf32"``, ``"ieee"``
    or ``"none"``, as ``torch.backends.cuda.matmul.fp32_precision`` reads it). TF32 only ever
    concerns fp32 operands: bf16 and fp16 dots are exact products either way, so they stay
    "ieee", as do fp32 inputs unless the user allowed TF32 for matmuls.
    """
    return "tf32" if dtype == torch.float32 and fp32_matmul_precision == "tf32" else "ieee"


def _assume_constant_result(fn: Any) -> Any:
    """What ``torch.compiler.assume_constant_result`` does (torch/_dynamo/decorators.py: it
    marks the function), without importing torch._dynamo, which adds 1.3 s to every worker's
    start-up (this module is imported by every model). tests/kernels/test_swa.py checks that
    the mark is still torch's."""
    fn._dynamo_marked_constant = True
    return fn


# Read once per compile trace, as a constant (dynamo cannot trace the getter): a compiled graph
# keeps the TF32 setting it was traced under, so set TF32 before compiling, as any torch flag.
@_assume_constant_result
def cuda_fp32_matmul_precision() -> str:
    """torch's CUDA fp32 matmul precision, ``"tf32"`` when TF32 is allowed.

    ``fp32_precision`` is the one reading that never raises: it resolves the global setting
    (``torch.backends.fp32_precision``) and reflects the legacy ones
    (``torch.backends.cuda.matmul.allow_tf32 = True``,
    ``torch.set_float32_matmul_precision("high")``), whereas reading ``allow_tf32`` raises once
    legacy and new APIs were both used to set it.
    """
    return str(torch.backends.cuda.matmul.fp32_precision)


def swa_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
              global_tokens: int) -> torch.Tensor:
    """The twin; q, k, v, result: (B, nh, T, hs)."""
    mask = mask_matrix(q.size(-2), window, global_tokens, q.device)  # (T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ``precision`` ("tf32" | "ieee", see dot_precision) is an argument of both ops, not read from
# torch inside them: the forward's choice is saved for the backward, so one step never mixes
# the two, and a compiled graph records it like the window.
@torch.library.custom_op("traind::swa_forward", mutates_args=())
def swa_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   global_tokens: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, nh, T, hs) like q, lse (B, nh, T) f32)``."""
    mod = _dispatch.triton_module("_swa_triton")
    return mod.forward(q, k, v, window, global_tokens, precision)


@swa_forward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
      global_tokens: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("traind::swa_backward", mutates_args=())
def swa_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, window: int, global_tokens: int,
                    precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like q, k, v."""
    mod = _dispatch.triton_module("_swa_triton")
    return mod.backward(do, q, k, v, o, lse, window, global_tokens, precision)


@swa_backward_op.register_fake
def _(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
      lse: torch.Tensor, window: int, global_tokens: int, precision: str
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, window, global_tokens, precision = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.window, ctx.global_tokens, ctx.precision = window, global_tokens, precision


def _backward(ctx: Any, do: torch.Tensor, _dlse: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = swa_backward_op(do, q, k, v, o, lse, ctx.window, ctx.global_tokens,
                                 ctx.precision)
    return dq, dk, dv, None, None, None


swa_forward_op.register_autograd(_backward, setup_context=_setup_context)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             window: int, global_tokens: int) -> torch.Tensor:
    """Causal sliding-window attention with global tokens; q, k, v: (B, nh, T, hs).
    The Triton kernel on CUDA, the SDPA-with-mask twin elsewhere. No dropout. fp32 inputs
    use TF32 in the kernel exactly when torch allows it for CUDA matmuls."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if _dispatch.use_triton(q):
        precision = dot_precision(q.dtype, cuda_fp32_matmul_precision())
        out, _ = swa_forward_op(q, k, v, window, global_tokens, precision)
        return out
    return swa_torch(q, k, v, window, global_tokens)
