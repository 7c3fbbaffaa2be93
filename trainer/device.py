"""What the device can do and what its allocator holds: inputs to MFU and memory panels.

The CUDA-only calls here and in the trainer's other device code take ``cuda``: ``torch.cuda``
(the default) or a stand-in with the same functions, so that a test on a machine without a GPU
runs the line and checks what it asks of CUDA (tests/trainer/test_cuda_paths.py).
"""

from __future__ import annotations

import re
import resource
from typing import Any

import torch

# Dense peak FLOP/s by product name and the math the matmuls run in (vendor datasheets;
# sparsity not counted): bf16 (fp16 alike) and fp8 on tensor cores, tf32 (traind's fp32 on
# CUDA: it allows TF32), plain fp32 on CUDA cores. None: the part lacks that math (no fp8
# before Ada/Hopper, no bf16 or TF32 on V100). MFU = achieved FLOP/s (tokens/s x FLOPs per
# token) / the peak of the math that runs: an fp8 run measured against the bf16 peak would
# read twice too high.
#
# A key matches a name (as NVML and torch.cuda.get_device_name report it: "NVIDIA H100 80GB
# HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-16GB") when its words appear in the name
# as whole words, in order and adjacent ("-" and "_" separate words too); the longest key that
# matches wins, so "H100 NVL" beats "H100", and "L4" never catches "NVIDIA L40" nor "H200"
# "NVIDIA GH200 480GB" (see :func:`peak_flops`). The parts with one name in several forms:
# H100 SXM reports "NVIDIA H100 80GB HBM3" (the bare "H100" row); A100 PCIe and SXM4 share
# their datasheet figures (PCIe's lower power shows in sustained clocks, not the peak).
MATH = ("bf16", "fp8", "tf32", "fp32")
PEAK_FLOPS: tuple[tuple[str, tuple[float | None, ...]], ...] = (
    # name          bf16      fp8       tf32      fp32
    ("H200", (989e12, 1979e12, 494.5e12, 67e12)),
    ("H200 NVL", (835e12, 1671e12, 418e12, 60e12)),  # 600 W PCIe card: NVL's figures
    ("H100 SXM", (989e12, 1979e12, 494.5e12, 67e12)),
    ("H100 NVL", (835e12, 1671e12, 418e12, 60e12)),
    ("H100 PCIe", (756e12, 1513e12, 378e12, 51e12)),
    ("H100", (989e12, 1979e12, 494.5e12, 67e12)),  # "NVIDIA H100 80GB HBM3": the SXM part
    ("GH200", (989e12, 1979e12, 494.5e12, 67e12)),
    ("B200", (2250e12, 4500e12, 1100e12, 75e12)),
    ("A100", (312e12, None, 156e12, 19.5e12)),
    ("L40S", (362e12, 733e12, 183e12, 91.6e12)),
    ("L40", (181e12, 362e12, 90.5e12, 90.5e12)),
    ("A10G", (70e12, None, 35e12, 31.2e12)),
    ("A10", (125e12, None, 62.5e12, 31.2e12)),
    ("L4", (121e12, 242e12, 60e12, 30.3e12)),
    ("V100", (125e12, None, None, 15.7e12)),  # SXM2; its 125 is fp16: no bf16 on Volta
    ("V100 PCIe", (112e12, None, None, 14e12)),
)


def _words(name: str) -> tuple[str, ...]:
    return tuple(re.findall(r"[a-z0-9]+", name.lower()))


# longest first (most words, then most letters): the first key that matches is the product
_KEYS = sorted(((_words(key), key) for key, _ in PEAK_FLOPS),
               key=lambda wk: (len(wk[0]), len(wk[1])), reverse=True)


def product(device_name: str) -> str | None:
    """The :data:`PEAK_FLOPS` key ``device_name`` is, or None: the longest key whose words
    appear in the name as adjacent whole words (never a prefix of a word: "L4" is not
    "L40", "H200" is not "GH200")."""
    words = _words(device_name)
    for key_words, key in _KEYS:
        n = len(key_words)
        if any(words[i:i + n] == key_words for i in range(len(words) - n + 1)):
            return key
    return None


def matmul_math(precision: str) -> str:
    """The math a precision mode's matmuls run in on CUDA (one of :data:`MATH`): fp32 runs
    as TF32 (the loop allows it); adaptive's blocks mostly drop to bf16 or fp16, so its peak
    is theirs (the higher one: an MFU never flattered)."""
    return {"fp32": "tf32", "fp8": "fp8"}.get(precision, "bf16")


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """The datasheet peak for ``device_name`` (as CUDA reports it; matched by
    :func:`product`) in the math ``precision``'s matmuls run in (:func:`matmul_math`), or
    None if unknown (the CPU, a GPU not in the table, a math the part lacks): MFU is then not
    computed rather than made up."""
    key = product(device_name)
    if key is None:
        return None
    return dict(PEAK_FLOPS)[key][MATH.index(matmul_math(precision))]


def device_name(device: torch.device, cuda: Any = None) -> str:
    """What the device calls itself (CUDA's product name, the key to :func:`peak_flops`), or
    "cpu". ``cuda``: ``torch.cuda`` (default) or a stand-in (tests)."""
    if device.type == "cuda":
        return str((cuda or torch.cuda).get_device_name(device))
    return "cpu"


def allow_tf32(device: torch.device, backends: Any = None) -> None:
    """On CUDA, TF32 matmuls and convolutions: fp32 master weights at tensor-core speed (the
    peak :func:`matmul_math` gives fp32). ``backends``: ``torch.backends`` (default) or a
    stand-in (tests)."""
    if device.type == "cuda":
        b = backends or torch.backends
        b.cuda.matmul.allow_tf32 = True
        b.cudnn.allow_tf32 = True


def device_synchronize(device: torch.device, cuda: Any = None) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU, where every
    op has finished when it returns. ``cuda``: ``torch.cuda`` (default) or a stand-in."""
    if device.type == "cuda":
        (cuda or torch.cuda).synchronize(device)


def allocator_stats(device: torch.device, cuda: Any = None) -> dict[str, float]:
    """CUDA caching-allocator figures (host-side counters: no device sync); empty on CPU.
    ``cuda``: ``torch.cuda`` (default) or a stand-in with its ``memory_stats`` (tests)."""
    if device.type != "cuda":
        return {}
    s = (cuda or torch.cuda).memory_stats(device)
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
