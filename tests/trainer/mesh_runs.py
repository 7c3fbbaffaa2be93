"""Real multi-rank jobs for the mesh tests (tensor and pipeline parallel): a tiny model's
config, and every rank's events of one torchrun job. Not a test module: imported by
tests/trainer/test_tensor_parallel.py and test_pipeline_parallel.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from traind.contracts.events import decode_complete

if TYPE_CHECKING:
    from pathlib import Path

STEPS = 8  # optimizer steps of each job unless a test asks for more


def config(out_dir: Path, *, batch: int, ranks: int = 1, steps: int = STEPS,
           **sections: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "job": {"steps": steps, "batch_size": batch, "threads": 1, "out_dir": str(out_dir),
                "eval_every": 10_000, "checkpoint_every": 10_000, "seed": 3,
                "nproc_per_node": ranks},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32},
        "data": {"max_bytes": 100_000},
        # constant lr (no warm-up, min = peak): a resumed run's schedule cannot differ
        "optim": {"lr": 1e-2, "warmup_steps": 0, "min_lr_ratio": 1.0, "grad_clip": 0.5},
        "telemetry": {"per_layer": False},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def run_ranks(tmp: Path, cfg: dict[str, Any], nproc: int) -> list[list[Any]]:
    """Every rank's events of one torchrun job."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    with open(tmp / "log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", "--max_restarts=0", "-m", "traind.trainer.worker",
             "--config", str(tmp / "config.json"), "--events-file", str(tmp / "events")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(240)
        except subprocess.TimeoutExpired:  # never leave a hung job behind the suite
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, (tmp / "log").read_text()[-4000:]
    return [decode_complete((tmp / f"events.rank{r}").read_bytes()) for r in range(nproc)]
