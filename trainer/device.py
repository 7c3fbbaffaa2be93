"""What the device can do and what its allocator holds: inputs to MFU and memory panels."""

from __future__ import annotations

import resource
from typing import Any

import torch

# Dense peak FLOP/s by product name and the math the matmuls run in (vendor datasheets;
# sparsity not counted): bf16 (fp16 alike) and fp8 on tensor cores, tf32 (traind's fp32 on
# CUDA: it allows TF32), plain fp32 on CUDA cores. None: the part lacks that math (no fp8
# before Ada/Hopper, no bf16 or TF32 on V100). MFU = achieved FLOP/s (tokens/s x FLOPs per
# token) / the peak of the math that runs: an fp8 run measured against the bf16 peak would
# read twice too high.
MATH = ("bf16", "fp8", "tf32", "fp32")
PEAK_FLOPS: tuple[tuple[str, tuple[float | None, ...]], ...] = (
    # name          bf16      fp8       tf32      fp32
    ("H200", (989e12, 1979e12, 494.5e12, 67e12)),
    ("H100 SXM", (989e12, 1979e12, 494.5e12, 67e12)),
    ("H100 NVL", (835e12, 1671e12, 418e12, 60e12)),
    ("H100 PCIe", (756e12, 1513e12, 378e12, 51e12)),
    ("H100", (989e12, 1979e12, 494.5e12, 67e12)),
    ("GH200", (989e12, 1979e12, 494.5e12, 67e12)),
    ("B200", (2250e12, 4500e12, 1100e12, 75e12)),
    ("A100", (312e12, None, 156e12, 19.5e12)),
    ("L40S", (362e12, 733e12, 183e12, 91.6e12)),
    ("A10G", (70e12, None, 35e12, 31.2e12)),
    ("L4", (121e12, 242e12, 60e12, 30.3e12)),
    ("V100", (125e12, None, None, 15.7e12)),  # its 125 is fp16: no bf16 on Volta
)


def matmul_math(precision: str) -> str:
    """The math a precision mode's matmuls run in on CUDA (one of :data:`MATH`): fp32 runs
    as TF32 (the loop allows it); adaptive's blocks mostly drop to bf16 or fp16, so its peak
    is theirs (the higher one: an MFU never flattered)."""
    return {"fp32": "tf32", "fp8": "fp8"}.get(precision, "bf16")


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """The datasheet peak for ``device_name`` (as CUDA reports it) in the math
    ``precision``'s matmuls run in (:func:`matmul_math`), or None if unknown (the CPU, a GPU
    not in the table, a math the part lacks): MFU is then not computed rather than made up."""
    column = MATH.index(matmul_math(precision))
    for key, flops in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return flops[column]
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
