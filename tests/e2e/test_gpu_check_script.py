"""bench/gpu_check.py is for a lent GPU; its product table runs here on the CPU (``--device
cpu``), so every line of it but the CUDA-only checks executes in the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
SETTINGS = ("ddp fp32 (hook)", "ddp bf16 int8 (hook)", "fsdp bf16")


def test_the_product_table_runs_on_the_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--steps",
         "8", "--only", ",".join(SETTINGS)],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    by_name = {r.split(" | ")[0][2:]: r for r in rows[2:]}
    assert set(by_name) == set(SETTINGS)
    for name in SETTINGS:
        assert " | ok | " in by_name[name], by_name[name]
    assert "collectives" in by_name["ddp fp32 (hook)"]  # the hook path ran and was counted


def test_an_unknown_setting_is_named() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--only",
         "nope"], capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 2 and "unknown settings ['nope']" in proc.stderr
