"""bench/gpu_check.py is for a lent GPU; its product table runs here on the CPU (``--device
cpu``), every setting of it, so every line of it but the CUDA-only checks executes in the
suite; the adaptive check's verdict (pure: events in, pass or fail out) is tested here too."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import REPO
from traind.contracts.events import PrecisionEvent, SNREvent
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path
    from types import ModuleType

pytestmark = pytest.mark.slow


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPU_CHECK = _gpu_check()


def test_every_setting_of_the_product_table_runs_on_the_cpu() -> None:
    names = [name for name, _ in GPU_CHECK.SETTINGS]
    # Two halves of the table at once: each setting is a one-rank job that spends most of its
    # time starting up and compiling on one core (the whole table one after the other took
    # 2 of the suite's 30 minutes on 2 cores).
    halves = [names[0::2], names[1::2]]
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--steps",
         "8", "--only", ",".join(half)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO) for half in halves]
    by_name: dict[str, str] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        rows = [line for line in out.splitlines() if line.startswith("| ")]
        by_name.update({r.split(" | ")[0][2:]: r for r in rows[2:]})
    assert len(names) == 12 and set(by_name) == set(names)
    for name in names:
        assert " | ok | " in by_name[name], by_name[name]
        assert by_name[name].split(" | ")[3] == "-", "no MFU on the CPU: no datasheet peak"
    assert "collectives" in by_name["ddp fp32 (hook)"]  # the hook path ran and was counted
    assert "fp8 layers" in by_name["wide fp8 rowwise compile"]


def test_an_unknown_setting_is_named() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--only",
         "nope"], capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 2 and "unknown settings ['nope']" in proc.stderr


def _adaptive_run(tmp_path: Path, **precision: Any) -> tuple[list[Any], Any]:
    """A tiny adaptive job on the CPU (tests/trainer/conftest.py's shape), every window
    reported."""
    cfg = TrainConfig.model_validate({
        "job": {"steps": 24, "batch_size": 4, "eval_every": 1000, "checkpoint_every": 1000,
                "threads": 1, "out_dir": tmp_path},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000}, "optim": {"warmup_steps": 5, "lr": 1e-2},
        "telemetry": {"every": 1},
        "precision": {"mode": "adaptive", "snr_window": 4, "min_dwell": 4, **precision}})
    sink = ListSink()
    train(cfg, sink)
    return sink.events, cfg.precision


def test_the_adaptive_verdict_holds_the_run_to_its_own_snrs(tmp_path: Path) -> None:
    """The check's verdict on a real (CPU, tiny) adaptive run: thresholds low enough that
    its 3 groups switch. The verdict passes it, and fails it when a switch the run's SNRs
    made due is missing, when one is made that they did not, when a window went unreported,
    and when no group switched at all."""
    verdict = GPU_CHECK.adaptive_verdict
    events, cfg = _adaptive_run(tmp_path / "a", snr_high=0.02, snr_low=0.01)
    assert "3 groups reached bf16" in verdict(events, cfg)
    switches = [e for e in events if isinstance(e, PrecisionEvent)]
    assert len(switches) >= 3
    missing = [e for e in events if e is not switches[0]]
    with pytest.raises(AssertionError, match="switches made"):
        verdict(missing, cfg)
    extra = [*events, dataclasses.replace(switches[0], step=switches[0].step + 4,
                                          before="bf16", after="fp32")]
    with pytest.raises(AssertionError, match="switches made"):
        verdict(extra, cfg)
    # the same run judged against a threshold its SNRs never passed: its switches were not due
    with pytest.raises(AssertionError, match="switches made"):
        verdict(events, cfg.model_copy(update={"snr_high": 1e9, "snr_low": 1e8}))
    first = min(e.window_step for e in events if isinstance(e, SNREvent) and e.window_step)
    gap = [e for e in events if not (isinstance(e, SNREvent) and e.window_step == first)]
    with pytest.raises(AssertionError, match="not every window reported"):
        verdict(gap, cfg)
    quiet, high = _adaptive_run(tmp_path / "b", snr_high=1e9, snr_low=1e8)
    with pytest.raises(AssertionError, match="0 groups switched to bf16"):
        verdict(quiet, high)
