"""Two nodes on one machine (network namespaces, a veth pair shaped by tc): a 2-node DDP job
trains across the link, uncompressed and with int8, via bench/multinode.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_real_part

pytestmark = pytest.mark.slow
BENCH = Path(__file__).parents[2] / "bench" / "multinode.py"


def test_a_two_node_job_trains_over_a_shaped_link(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and tc need root")
    require_real_part("ip", "apt-get install iproute2")
    require_real_part("tc", "apt-get install iproute2")
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--rates", "1gbit", "--methods", "none,int8",
         "--steps", "8", "--warmup", "2", "--d-model", "64", "--layers", "2",
         "--timeout", "240", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    for row in rows.values():
        assert row["final_step"] == [8, 8], row  # both nodes' ranks trained to the end
        assert row["comm_ms"] > 0 and row["step_ms"] > 0
    # int8 sends a quarter of the bytes (plus its scales) and trains the same way.
    assert 3.5 < rows["none"]["sent_mb"] / rows["int8"]["sent_mb"] < 4.0
    for a, b in zip(rows["none"]["final_loss"], rows["int8"]["final_loss"], strict=True):
        assert abs(a - b) < 0.05
    assert "| 1gbit | int8 |" in proc.stdout  # the table
