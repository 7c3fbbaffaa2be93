"""bench/kernels_gpu.py is for a GPU machine; here it must import and leave cleanly."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.conftest import REPO

NEEDS_TRITON = False  # the script's CPU path never touches triton


def test_without_cuda_it_says_so_and_exits_zero() -> None:
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine runs the real thing
        return
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "kernels_gpu.py")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
