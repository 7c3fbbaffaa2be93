"""What the device can do and what its allocator holds: inputs to MFU and memory panels."""

from __future__ import annotations

import resource
from typing import Any

import torch

# Dense bf16/fp16 tensor-core peak FLOP/s by product name (vendor datasheets; sparsity not
# counted). MFU = achieved FLOP/s (tokens/s x FLOPs per token) / this.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 SXM", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("V100", 125e12),
)


def peak_flops(device_name: str) -> float | None:
    """The datasheet peak for ``device_name`` (as CUDA reports it), or None if unknown (the
    CPU, a GPU not in the table): MFU is then not computed rather than made up."""
    for key, flops in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def allocator_stats(device: torch.device) -> dict[str, float]:
    """CUDA caching-allocator figures (host-side counters: no device sync); empty on CPU."""
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {
        "allocated_bytes": float(s.get("allocated_bytes.all.current", 0)),
        "reserved_bytes": float(s.get("reserved_bytes.all.current", 0)),
        "peak_allocated_bytes": float(s.get("allocated_bytes.all.peak", 0)),
        "alloc_retries": float(s.get("num_alloc_retries", 0)),
        "ooms": float(s.get("num_ooms", 0)),
    }


def peak_memory(device: torch.device, cuda: Any = None) -> dict[str, float]:
    """This rank's peak memory so far, in bytes: ``host_rss`` (the process's peak resident
    set, ru_maxrss, KiB on Linux: the torch runtime, the data and, on CPU, the tensors) and
    on a GPU ``device_allocated`` (the caching allocator's peak). ``cuda``: ``torch.cuda``
    (default) or a stand-in with its ``max_memory_allocated`` (tests: the GPU line runs on
    CPU too)."""
    out = {"host_rss": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    if device.type == "cuda":
        out["device_allocated"] = float((cuda or torch.cuda).max_memory_allocated(device))
    return out
