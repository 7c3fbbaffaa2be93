"""Stopping and killing the daemon while it trains: the job ends preempted and resumes."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

import psutil
import pytest

from tests.conftest import start_daemon, stop_daemon

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow
SETS = ("job.checkpoint_every=10", "telemetry.every=1")


def _run(d: Any) -> dict[str, Any]:
    runs = d.get("/api/runs").json()
    assert len(runs) == 1, runs
    return runs[0]


def _wait_step(d: Any, step: int, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _run(d)
        if run["state"] == "running" and run["summary"].get("step", 0) >= step:
            return run
        time.sleep(0.3)
    raise AssertionError(f"step {step} not reached:\n{d.log.read_text()[-3000:]}")


def _events(d: Any, run_id: int, kind: str) -> list[dict[str, Any]]:
    from traind.daemon.db import crud
    from traind.daemon.db.engine import default_url, make_engine

    time.sleep(1.5)  # the daemon writes events to the database every second
    return crud.run_events(make_engine(default_url(d.var_dir)), run_id=run_id, kind=kind)


def test_sigterm_preempts_at_a_checkpoint_and_the_next_start_resumes(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, steps=100_000, sets=SETS)
    try:
        run = _wait_step(d, 15)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0, d.log.read_text()[-3000:]
        (finished,) = _events(d, run["id"], "finished")
        from traind.daemon.db import crud
        from traind.daemon.db.engine import default_url, make_engine

        stored = crud.get_run(make_engine(default_url(d.var_dir)), run_id=run["id"])
        assert stored is not None and stored.state == "preempted", stored
        d = start_daemon(tmp_path, steps=100_000, sets=SETS)
        # The same run, training again past where it stopped; no second default job.
        again = _wait_step(d, finished["step"] + 3)
        assert again["id"] == run["id"]
        (resumed,) = _events(d, run["id"], "resumed")
        # Every rank saved at the step they stopped at, and the job went on from there.
        assert resumed["step"] == finished["step"] and finished["data"]["stopped"]
    finally:
        stop_daemon(d)


def test_a_killed_daemon_leaves_no_workers_and_its_job_resumes(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, steps=100_000, sets=SETS)
    try:
        run = _wait_step(d, 25)  # past the checkpoint at 20
        workers = psutil.Process(d.proc.pid).children(recursive=True)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
        _gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, [p.cmdline() for p in alive]  # nothing runs twice
        d = start_daemon(tmp_path, steps=100_000, sets=SETS)
        again = _wait_step(d, run["summary"]["step"] + 3)
        assert again["id"] == run["id"]
        (resumed,) = _events(d, run["id"], "resumed")
        # From the last checkpoint: the periodic one at 20 or later, or the one the workers
        # wrote when they lost their parent (PDEATHSIG is a SIGTERM: they save and leave).
        assert resumed["step"] >= 20
    finally:
        stop_daemon(d)
