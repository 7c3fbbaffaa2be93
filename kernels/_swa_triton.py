"""Triton kernels for :mod:`traind.kernels.swa`: FlashAttention-2 style forward and backward.

q, k, v are (B·nh, T, hs) contiguous. A query block visits only the key blocks that can hold
an allowed column: the global block(s) at the start, then the blocks from the window's start
to the diagonal; the ``allowed`` rule masks within a block. Scores never leave registers:
the forward keeps a running max and sum per row (online softmax) and stores the row's
log-sum-exp, from which the backward recomputes each probability block. Every ``tl.dot``
takes its input precision from the ``PRECISION`` constexpr (swa.dot_precision: "tf32" for fp32
inputs when torch allows TF32, else "ieee").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from traind.kernels import _dispatch


@triton.jit
def _allowed(offs_m, offs_n, T, window, n_global):
    """trainer/attention.py's rule for a (BLOCK_M, BLOCK_N) tile, plus the sequence end."""
    q_i, kv_i = offs_m[:, None], offs_n[None, :]
    return (q_i >= kv_i) & ((q_i - kv_i < window) | (kv_i < n_global)) & (kv_i < T)


@triton.jit
def _load_rows(ptr, offs, offs_d, T, HS, DOT: tl.constexpr):
    mask = (offs[:, None] < T) & (offs_d[None, :] < HS)
    return tl.load(ptr + offs[:, None] * HS + offs_d[None, :], mask=mask, other=0.0).to(DOT)


@triton.jit
def _fwd_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_d, T, HS, window,
               n_global, scale, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
               PRECISION: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_ptr, offs_n, offs_d, T, HS, DOT)  # (BN, D)
    v = _load_rows(v_ptr, offs_n, offs_d, T, HS, DOT)  # (BN, D)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BM, BN)
    s = tl.where(_allowed(offs_m, offs_n, T, window, n_global), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # p rounded to v's dtype, as FlashAttention feeds the second matmul
    p = p.to(v_ptr.dtype.element_ty).to(DOT)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T, HS, window, n_global, scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    q_ptr += bh * T * HS
    k_ptr += bh * T * HS
    v_ptr += bh * T * HS
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr, offs_m, offs_d, T, HS, DOT)  # (BM, D)
    # finite start: a row whose first block is all masked keeps exp(m_i - m_new) = 1, not NaN
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N  # the window's first block
    hi = tl.minimum(start_m + BLOCK_M, T)
    global_hi = tl.minimum(lo, tl.cdiv(n_global, BLOCK_N) * BLOCK_N)  # never overlaps [lo, hi)
    for start_n in range(0, global_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_d, T,
                                   HS, window, n_global, scale, BLOCK_N, DOT, PRECISION)
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_d, T,
                                   HS, window, n_global, scale, BLOCK_N, DOT, PRECISION)
    # rows past the sequence end may see no column at all; 1 keeps them finite (unstored)
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    mask = (offs_m[:, None] < T) & (offs_d[None, :] < HS)
    o_ptr += bh * T * HS
    tl.store(o_ptr + offs_m[:, None] * HS + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mask)
    tl.store(lse_ptr + bh * T + offs_m, m_i + tl.log(l_i), mask=offs_m < T)


@triton.jit
def _probs_and_dscores(q, k, v, do, lse, delta, offs_m, offs_n, T, window, n_global, scale,
                       PRECISION: tl.constexpr):
    """Recomputed probabilities p and score gradients ds of one (BM, BN) tile, fp32."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    ok = _allowed(offs_m, offs_n, T, window, n_global) & (offs_m[:, None] < T)
    p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, T, HS,
                     window, n_global, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    for_ptr = bh * T * HS
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr + for_ptr, offs_n, offs_d, T, HS, DOT)  # (BN, D)
    v = _load_rows(v_ptr + for_ptr, offs_n, offs_d, T, HS, DOT)  # (BN, D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Queries that may see this key block: from its diagonal to window-1 rows past its end,
    # or to the end of the sequence when the block holds global columns.
    q_lo = start_n // BLOCK_M * BLOCK_M
    q_hi = tl.where(start_n < n_global, T, tl.minimum(T, start_n + BLOCK_N + window - 1))
    for start_m in range(q_lo, q_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_ptr + for_ptr, offs_m, offs_d, T, HS, DOT)  # (BM, D)
        do = _load_rows(do_ptr + for_ptr, offs_m, offs_d, T, HS, DOT)  # (BM, D)
        lse = tl.load(lse_ptr + bh * T + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(delta_ptr + bh * T + offs_m, mask=offs_m < T, other=0.0)
        p, ds = _probs_and_dscores(q, k, v, do, lse, delta, offs_m, offs_n, T, window,
                                   n_global, scale, PRECISION)
        p = p.to(v_ptr.dtype.element_ty).to(DOT)
        ds = ds.to(q_ptr.dtype.element_ty).to(DOT)
        dv += tl.dot(tl.trans(p), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds), q, input_precision=PRECISION)
    mask = (offs_n[:, None] < T) & (offs_d[None, :] < HS)
    out = for_ptr + offs_n[:, None] * HS + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_ptr, v_ptr, start_n, offs_m, offs_d, T, HS, window,
              n_global, scale, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
              PRECISION: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(k_ptr, offs_n, offs_d, T, HS, DOT)
    v = _load_rows(v_ptr, offs_n, offs_d, T, HS, DOT)
    _, ds = _probs_and_dscores(q, k, v, do, lse, delta, offs_m, offs_n, T, window, n_global,
                               scale, PRECISION)
    return dq + tl.dot(ds.to(k_ptr.dtype.element_ty).to(DOT), k, input_precision=PRECISION)


@triton.jit
def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, T, HS, window,
                   n_global, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    for_ptr = bh * T * HS
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr + for_ptr, offs_m, offs_d, T, HS, DOT)
    do = _load_rows(do_ptr + for_ptr, offs_m, offs_d, T, HS, DOT)
    lse = tl.load(lse_ptr + bh * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(delta_ptr + bh * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, T)
    global_hi = tl.minimum(lo, tl.cdiv(n_global, BLOCK_N) * BLOCK_N)
    for start_n in range(0, global_hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptr + for_ptr, v_ptr + for_ptr, start_n, offs_m,
                       offs_d, T, HS, window, n_global, scale, BLOCK_N, DOT, PRECISION)
    for start_n in range(lo, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptr + for_ptr, v_ptr + for_ptr, start_n, offs_m,
                       offs_d, T, HS, window, n_global, scale, BLOCK_N, DOT, PRECISION)
    mask = (offs_m[:, None] < T) & (offs_d[None, :] < HS)
    tl.store(dq_ptr + for_ptr + offs_m[:, None] * HS + offs_d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask)


def _config(q: torch.Tensor, precision: str) -> dict[str, object]:
    # The interpreter has no working bf16 tl.dot (triton 3.7): there both operands go up to
    # fp32 after the same roundings, which changes no product (bf16 x bf16 is exact in fp32).
    # Small tiles under the interpreter keep several blocks per test sequence.
    interp = _dispatch.interpreting()
    dot = tl.float32 if interp or q.dtype == torch.float32 else tl.bfloat16
    if q.dtype == torch.float16 and not interp:
        dot = tl.float16
    tile = 16 if interp else 64
    # PRECISION is swa.dot_precision's answer, decided on the host: a constexpr, so the tf32
    # and the ieee variant are two compiled kernels, each with no branch inside.
    return {"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_D": max(16, triton.next_power_of_2(
        q.size(-1))), "DOT": dot, "PRECISION": precision}


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, n_global: int,
            precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, HS = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = _dispatch.new_output((B, H, T, HS), q.dtype, q.device)
    lse = _dispatch.new_output((B, H, T), torch.float32, q.device)
    cfg = _config(q, precision)
    grid = (triton.cdiv(T, cfg["BLOCK_M"]), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, T, HS, window, n_global, HS**-0.5, **cfg)
    return o, lse


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             o: torch.Tensor, lse: torch.Tensor, window: int, n_global: int, precision: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, T, HS = q.shape
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    delta = (o.float() * do.float()).sum(dim=-1).contiguous()  # (B, H, T): rowsum(dO * O)
    dq = _dispatch.new_output((B, H, T, HS), q.dtype, q.device)
    dk = _dispatch.new_output((B, H, T, HS), k.dtype, q.device)
    dv = _dispatch.new_output((B, H, T, HS), v.dtype, q.device)
    cfg = _config(q, precision)
    scale = HS**-0.5
    grid_n = (triton.cdiv(T, cfg["BLOCK_N"]), B * H)
    _bwd_dkdv_kernel[grid_n](q, k, v, do, lse, delta, dk, dv, T, HS, window, n_global, scale,
                             **cfg)
    grid_m = (triton.cdiv(T, cfg["BLOCK_M"]), B * H)
    _bwd_dq_kernel[grid_m](q, k, v, do, lse, delta, dq, T, HS, window, n_global, scale, **cfg)
    return dq, dk, dv
