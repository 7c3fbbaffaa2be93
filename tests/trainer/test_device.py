"""trainer/device.py: the peak-FLOPS table matched by the names CUDA really reports, and the
device's CUDA-only figures (product name, allocator, TF32, synchronize) against a stand-in
for ``torch.cuda``: the GPU lines run on the CPU and say what they ask of CUDA."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from traind.trainer.device import (
    MATH,
    PEAK_FLOPS,
    allocator_stats,
    allow_tf32,
    device_name,
    device_synchronize,
    peak_flops,
    product,
)

ROWS = dict(PEAK_FLOPS)

# The names NVML and torch.cuda.get_device_name report (nvidia-smi -L, cloud instance docs),
# each with the row it must get; near-misses sit beside what they must not be taken for.
NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100"),  # the SXM5 part reports no "SXM"
    ("NVIDIA H100 SXM5 80GB", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA GH200 144G HBM3e", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA B200", "B200"),
    ("Tesla V100-SXM2-32GB", "V100"),
    ("Tesla V100-SXM2-16GB", "V100"),
    ("Tesla V100-PCIE-16GB", "V100 PCIe"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    # not in the table: no peak, so no MFU, rather than a neighbour's figures
    ("NVIDIA RTX 6000 Ada Generation", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA A40", None),
    ("NVIDIA GB200", None),  # not "B200"
    ("NVIDIA H800", None),
    ("Tesla V100S-PCIE-32GB", None),  # V100S: not "V100"
    ("cpu", None),
    ("", None),
]


@pytest.mark.parametrize(("name", "key"), NAMES)
def test_a_reported_name_gets_its_own_row(name: str, key: str | None) -> None:
    assert product(name) == key
    expected = ROWS[key] if key is not None else (None,) * len(MATH)
    # bf16 and fp8 on tensor cores; traind's fp32 runs as TF32 (the plain fp32 column is
    # the CUDA-core figure, kept for reference)
    assert [peak_flops(name, p) for p in ("bf16", "fp8", "fp32")] == [
        expected[MATH.index(m)] for m in ("bf16", "fp8", "tf32")]


def test_every_row_is_named_by_its_key_alone_and_in_a_full_name() -> None:
    assert len(ROWS) == len(PEAK_FLOPS)  # no key twice
    for key in ROWS:
        assert product(key) == key
        assert product(f"NVIDIA {key}") == key
        assert product(f"NVIDIA {key.lower()}") == key  # case as reported varies


@pytest.mark.parametrize(
    ("name", "neighbour"),
    [("NVIDIA L40", "NVIDIA L4"), ("NVIDIA L40", "NVIDIA L40S"),
     ("NVIDIA H200 NVL", "NVIDIA H200"), ("NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"),
     ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"), ("NVIDIA A10G", "NVIDIA A10"),
     ("Tesla V100-PCIE-16GB", "Tesla V100-SXM2-32GB")],
)
def test_near_misses_have_different_datasheet_peaks(name: str, neighbour: str) -> None:
    """The rows that prefix matching confused are different parts, with different figures:
    a match that fell through to the neighbour would change the MFU."""
    assert peak_flops(name, "bf16") != peak_flops(neighbour, "bf16")


def test_datasheet_figures_of_the_parts_added() -> None:
    # H200 NVL (600 W PCIe card): 1671 TFLOPS bf16 with sparsity, so 835 dense
    assert peak_flops("NVIDIA H200 NVL", "bf16") == 835e12
    assert peak_flops("NVIDIA H200 NVL", "fp8") == 1671e12
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA L40", "bf16") == 181e12
    assert peak_flops("NVIDIA L40", "fp8") == 362e12
    assert peak_flops("NVIDIA L40", "fp32") == 90.5e12  # TF32 dense
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("NVIDIA GH200 480GB", "bf16") == 989e12


def test_the_cuda_product_name_is_what_the_peak_is_looked_up_by() -> None:
    asked: list[torch.device] = []

    def get_device_name(device: torch.device) -> str:
        asked.append(device)
        return "NVIDIA H200 NVL"

    cuda = SimpleNamespace(get_device_name=get_device_name)
    name = device_name(torch.device("cuda", 1), cuda=cuda)
    assert name == "NVIDIA H200 NVL" and asked == [torch.device("cuda", 1)]
    assert peak_flops(name, "bf16") == 835e12
    assert device_name(torch.device("cpu"), cuda=cuda) == "cpu" and len(asked) == 1


def test_allocator_stats_map_cuda_memory_stats_to_the_event_keys() -> None:
    stats = {"allocated_bytes.all.current": 5, "reserved_bytes.all.current": 8,
             "allocated_bytes.all.peak": 7, "num_alloc_retries": 2, "num_ooms": 1,
             "allocated_bytes.small_pool.current": 99, "reserved_bytes.all.peak": 99}
    asked: list[torch.device] = []

    def memory_stats(device: torch.device) -> dict[str, int]:
        asked.append(device)
        return stats

    cuda = SimpleNamespace(memory_stats=memory_stats)
    assert allocator_stats(torch.device("cuda", 0), cuda=cuda) == {
        "allocated_bytes": 5.0, "reserved_bytes": 8.0, "peak_allocated_bytes": 7.0,
        "alloc_retries": 2.0, "ooms": 1.0}
    assert asked == [torch.device("cuda", 0)]
    # a fresh allocator reports no keys yet: zeros, not a KeyError
    cuda = SimpleNamespace(memory_stats=lambda device: {})
    assert set(allocator_stats(torch.device("cuda", 0), cuda=cuda).values()) == {0.0}
    assert allocator_stats(torch.device("cpu"), cuda=cuda) == {}


def _backends() -> Any:
    return SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=False)),
                           cudnn=SimpleNamespace(allow_tf32=False))


def test_tf32_is_allowed_on_cuda_only() -> None:
    on, off = _backends(), _backends()
    allow_tf32(torch.device("cuda", 0), backends=on)
    allow_tf32(torch.device("cpu"), backends=off)
    assert on.cuda.matmul.allow_tf32 and on.cudnn.allow_tf32
    assert not off.cuda.matmul.allow_tf32 and not off.cudnn.allow_tf32


def test_synchronize_waits_for_the_cuda_device_and_not_the_cpu() -> None:
    waited: list[torch.device] = []
    cuda = SimpleNamespace(synchronize=waited.append)
    device_synchronize(torch.device("cuda", 1), cuda=cuda)
    device_synchronize(torch.device("cpu"), cuda=cuda)
    assert waited == [torch.device("cuda", 1)]
