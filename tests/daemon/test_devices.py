"""The daemon's device facts come from NVML, never from CUDA: a fake NVML answers, torch.cuda
raises, and the daemon's admission, auto-tuner and experiment rows still work; a walk over the
daemon's modules fails on any new torch.cuda call."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

import traind
from tests.daemon.test_node import _node
from traind.daemon import admission
from traind.daemon.autotune import runner as autotuner
from traind.daemon.devices import Devices, Gpu, read_devices, visible
from traind.daemon.service import AutotuneSpec, ExperimentSpec

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(traind.__file__).parent
# The daemon's process: every package it imports at run time except the trainer (the workers')
# and the kernels; cli/ once the CLI lives there (traind run trains in the foreground, so the
# trainer's own device choice stays the trainer's).
DAEMON_DIRS = ("daemon", "web", "metrics")


class FakeNvml:
    """pynvml's calls the daemon makes, for a node of ``gpus`` (name, uuid, capability)."""

    def __init__(self, gpus: list[tuple[str, str, tuple[int, int]]], *,
                 init_error: Exception | None = None) -> None:
        self.gpus, self.init_error, self.open = gpus, init_error, 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.gpus[h][0].encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h][1]

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self.gpus[h][2]


H100 = ("NVIDIA H100 80GB HBM3", "GPU-aaaa", (9, 0))
A100 = ("NVIDIA A100-SXM4-40GB", "GPU-bbbb", (8, 0))


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every torch.cuda query raises: a daemon code path that asks CUDA fails the test."""
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the daemon must not initialise CUDA")

    for name in ("is_available", "device_count", "get_device_capability", "get_device_name",
                 "get_device_properties", "current_device", "init", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    yield


def test_nvml_gives_count_name_and_capability() -> None:
    nvml = FakeNvml([H100, A100])
    found = read_devices(nvml, cuda_build=True, env={})
    assert found.count == 2 and found.kind == "cuda" and found.gpus[0].name == H100[0]
    assert found.capability == (8, 0)  # the lowest: a job's ranks span every GPU
    assert nvml.open == 0  # shut down again (NVML counts its inits)


@pytest.mark.parametrize(("nvml", "cuda_build", "reason"), [
    (FakeNvml([], init_error=RuntimeError("NVML Shared Library Not Found")), True,
     "no NVIDIA device: NVML Shared Library Not Found"),
    (FakeNvml([]), True, "NVML reports 0 GPUs"),
    (FakeNvml([H100]), False, "this torch build has no CUDA"),
])
def test_no_gpu_says_why(nvml: FakeNvml, cuda_build: bool, reason: str) -> None:
    found = read_devices(nvml, cuda_build=cuda_build, env={})
    assert found == Devices(reason=reason) and found.kind == "cpu" and found.capability is None


def test_this_host_has_no_gpu_and_says_so(no_cuda: None) -> None:
    found = read_devices()  # the real pynvml (and torch): no libnvidia-ml here
    if found.count == 0:
        assert found.reason
    else:  # a GPU machine: NVML named them without CUDA
        assert all(g.capability >= (3, 0) for g in found.gpus)


@pytest.mark.parametrize(("spec", "indexes"), [
    (None, [0, 1, 2]), ("", []), ("2,0", [2, 0]), ("GPU-bb", [1]), ("1,7,2", [1]),
    ("0,0", [0]), ("-1", []), ("GPU-", []),
])
def test_cuda_visible_devices_narrows_the_gpus(spec: str | None, indexes: list[int]) -> None:
    gpus = [Gpu(0, "GPU-aaaa", "x", (9, 0)), Gpu(1, "GPU-bbbb", "x", (9, 0)),
            Gpu(2, "GPU-abcd", "x", (9, 0))]
    assert [g.index for g in visible(gpus, spec)] == indexes


def test_daemon_paths_work_with_cuda_refusing(no_cuda: None, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Known gap, not the daemon's own call: importing torchao (the tuner asks whether fp8
    # can run) calls torch.cuda.is_available() at torchao's import time.
    monkeypatch.setattr(autotuner, "torchao_available", lambda: True)
    assert admission.resources().gpus == read_devices().count
    node = _node(tmp_path)
    hw = autotuner.hardware(node.settings, AutotuneSpec(name="t"))
    assert hw.device == read_devices().kind

    async def nothing() -> None:  # record the experiment; its job is not the point here
        return None

    monkeypatch.setattr(node.interleaved, "start_queued", nothing)
    spec = ExperimentSpec(name="e", steps=80, arms=({"name": "a"}, {"name": "b"}))
    info = asyncio.run(node.service.submit_experiment(spec))
    assert info.versions["device"] == read_devices().kind


def test_gpu_facts_feed_the_tuner_without_cuda(no_cuda: None, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    h100 = Devices((Gpu(0, "GPU-aaaa", H100[0], H100[2]),))
    monkeypatch.setattr(autotuner, "read_devices", lambda: h100)
    monkeypatch.setattr(admission, "read_devices", lambda: h100)
    monkeypatch.setattr(autotuner, "torchao_available", lambda: True)  # see above
    assert admission.resources().gpus == 1
    hw = autotuner.hardware(_node(tmp_path).settings, AutotuneSpec(name="t"))
    assert hw.device == "cuda" and hw.fp8  # fp8 tensor cores from capability 8.9


def _cuda_calls(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(
                node.value, ast.Name) and node.value.id == "torch":
            yield node.lineno, "torch.cuda"
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("torch.cuda")
                or (node.module == "torch" and any(a.name == "cuda" for a in node.names))):
            yield node.lineno, f"from {node.module} import ..."
        elif isinstance(node, ast.Import) and any(
                a.name.startswith("torch.cuda") for a in node.names):
            yield node.lineno, "import torch.cuda"


def test_the_daemon_has_no_torch_cuda_call() -> None:
    dirs = [ROOT / d for d in (*DAEMON_DIRS, "cli") if (ROOT / d).is_dir()]
    found = [f"{path.relative_to(ROOT)}:{line}: {what}"
             for d in dirs for path in sorted(d.rglob("*.py"))
             for line, what in _cuda_calls(ast.parse(path.read_text(), str(path)))]
    assert found == [], "the daemon initialises CUDA here (use daemon/devices.py):\n" + \
        "\n".join(found)
    # The walk finds what it looks for.
    assert list(_cuda_calls(ast.parse("import torch\ntorch.cuda.is_available()\n")))
    assert list(_cuda_calls(ast.parse("from torch import cuda\n")))
