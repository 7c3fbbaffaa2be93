"""Triton kernel for :mod:`traind.kernels.grad_stats`: one launch over every tensor's chunks.

A program owns CHUNK elements of one tensor; a table maps program -> (tensor, start), and a
table of raw addresses maps tensor -> its gradient. The chunk tables depend only on the
tensors' sizes, so only the addresses (8 bytes a tensor) go to the device per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from traind.kernels import _dispatch

CHUNK = 2048


@triton.jit
def _sq_norm_kernel(addr_ptr, chunk_tensor_ptr, chunk_start_ptr, numel_ptr, partial_ptr,
                    CHUNK: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + c)
    start = tl.load(chunk_start_ptr + c)
    n = tl.load(numel_ptr + t)
    g_ptr = tl.load(addr_ptr + t).to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, CHUNK)
    g = tl.load(g_ptr + offs, mask=offs < n, other=0.0)
    tl.store(partial_ptr + c, tl.sum(g * g, axis=0))  # masked lanes hold 0


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


def group_sq_norms(grads: list[torch.Tensor], group_of: torch.Tensor,
                   n_groups: int) -> torch.Tensor:
    device = grads[0].device if grads else group_of.device
    sums = torch.zeros(n_groups, dtype=torch.float32, device=device)
    if not grads:
        return sums
    grads = [g.float().contiguous() for g in grads]  # no copy when already so
    key = (tuple(g.numel() for g in grads), device)
    if key not in _TABLES:  # the model's shapes do not change between steps
        _TABLES[key] = _tables(key[0], device)
    chunk_tensor, chunk_start, numels, tensor_of = _TABLES[key]
    addrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64, device=device)
    n_chunks = len(tensor_of)
    partials = _dispatch.new_output((n_chunks,), torch.float32, device)
    if n_chunks:
        _sq_norm_kernel[(n_chunks,)](addrs, chunk_tensor, chunk_start, numels, partials,
                                     CHUNK=CHUNK)
        chunk_group = group_of.to(device)[chunk_tensor.long()]  # (n_chunks,)
        sums.index_add_(0, chunk_group, partials)
    return sums
