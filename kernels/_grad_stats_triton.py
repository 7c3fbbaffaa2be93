"""Triton kernel for :mod:`traind.kernels.grad_stats`: one launch over every tensor's chunks.

A program owns CHUNK elements of one tensor; a table maps program -> (tensor, start), and a
table of raw addresses maps tensor -> (grad, mean, m2). The tables depend only on the tensors'
sizes and the grads' addresses, so a few hundred bytes go to the device per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from traind.kernels import _dispatch

CHUNK = 2048


@triton.jit
def _welford_kernel(addr_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr, numel_ptr,
                    partial_ptr, n_chunks, inv_count, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + c)
    start = tl.load(chunk_start_ptr + c)
    n = tl.load(numel_ptr + t)
    g_ptr = tl.load(addr_ptr + t).to(tl.pointer_type(tl.float32))
    mean_ptr = tl.load(addr_ptr + n_tensors + t).to(tl.pointer_type(tl.float32))
    m2_ptr = tl.load(addr_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, CHUNK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    mean = tl.load(mean_ptr + offs, mask=mask, other=0.0)
    m2 = tl.load(m2_ptr + offs, mask=mask, other=0.0)
    delta = g - mean  # g - mean_{n-1}
    mean = mean + inv_count * delta
    m2 = m2 + delta * (g - mean)  # (g - mean_{n-1})(g - mean_n)
    tl.store(mean_ptr + offs, mean, mask=mask)
    tl.store(m2_ptr + offs, m2, mask=mask)
    tl.store(partial_ptr + c, tl.sum(mean * mean, axis=0))  # masked lanes hold 0
    tl.store(partial_ptr + n_chunks + c, tl.sum(m2, axis=0))


def _tables(numels: tuple[int, ...], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    tensor_of, start_of = [], []
    for i, n in enumerate(numels):
        for start in range(0, n, CHUNK):
            tensor_of.append(i)
            start_of.append(start)
    return (torch.tensor(tensor_of, dtype=torch.int32, device=device),
            torch.tensor(start_of, dtype=torch.int64, device=device),
            torch.tensor(numels, dtype=torch.int64, device=device), tensor_of)


_TABLES: dict[tuple[tuple[int, ...], torch.device],
              tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = {}


def welford_update(grads: list[torch.Tensor], mean: list[torch.Tensor], m2: list[torch.Tensor],
                   count: int, group_of: torch.Tensor, n_groups: int) -> torch.Tensor:
    device = mean[0].device if mean else group_of.device
    sums = torch.zeros(2, n_groups, dtype=torch.float32, device=device)
    if not mean:
        return sums
    for t in (*mean, *m2):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("mean and m2 must be contiguous float32 tensors")
    grads = [g.float().contiguous() for g in grads]  # no copy when already so
    key = (tuple(t.numel() for t in mean), device)
    if key not in _TABLES:  # the model's shapes do not change between steps
        _TABLES[key] = _tables(key[0], device)
    chunk_tensor, chunk_start, numels, tensor_of = _TABLES[key]
    addrs = torch.tensor([t.data_ptr() for t in (*grads, *mean, *m2)], dtype=torch.int64,
                         device=device)
    n_chunks = len(tensor_of)
    partials = _dispatch.new_output((2, n_chunks), torch.float32, device)
    if n_chunks:
        _welford_kernel[(n_chunks,)](addrs, len(mean), chunk_tensor, chunk_start, numels,
                                     partials, n_chunks, 1.0 / count, CHUNK=CHUNK)
        chunk_group = group_of.to(device)[chunk_tensor.long()]  # (n_chunks,)
        sums.index_add_(1, chunk_group, partials)
    return sums
