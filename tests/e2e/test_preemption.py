"""Stopping and killing the daemon while it trains: the job ends preempted and resumes."""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import httpx
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

    engine = make_engine(default_url(d.var_dir))
    deadline = time.monotonic() + 60  # the daemon writes events to the database every second
    while not (found := crud.run_events(engine, run_id=run_id, kind=kind)):
        assert time.monotonic() < deadline, f"no {kind} event of run {run_id}"
        time.sleep(0.3)
    return found


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


def _stored(d: Any, run_id: int) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]],
                                        list[int]]:
    """What the database holds of the run, every row as stored (no merge): the lead's steps,
    each rank's per-rank steps and comm report steps, and the checkpoint events' steps."""
    from traind.daemon.db import crud
    from traind.daemon.db.engine import default_url, make_engine
    from traind.daemon.ingest.series import COMM, RANK_STEPS, STEPS

    engine = make_engine(default_url(d.var_dir))
    steps = [s for c in crud.run_chunks(engine, run_id=run_id, kind=STEPS) for s in c["step"]]
    ranks: dict[int, list[int]] = {}
    for c in crud.run_chunks(engine, run_id=run_id, kind=RANK_STEPS):
        for s, r in zip(c["step"], c["rank"], strict=True):
            ranks.setdefault(r, []).append(s)
    comm: dict[int, list[int]] = {}
    for c in crud.run_chunks(engine, run_id=run_id, kind=COMM):
        for s, r in zip(c["reports"]["step"], c["reports"]["rank"], strict=True):
            comm.setdefault(r, []).append(s)
    ckpts = [e["step"] for e in crud.run_events(engine, run_id=run_id, kind="checkpoint")]
    return steps, ranks, comm, ckpts


def test_two_daemon_kills_lose_no_step_and_no_checkpoint_of_a_two_rank_run(
        tmp_path: Path) -> None:
    """Issue 40.1: a SIGKILLed daemon lost the events it had not flushed and its ranks' last
    ones (their stop checkpoint's among them): stored steps jumped 746 -> 749. Each rank
    spools what it sends; the next daemon waits for the old ranks to save and leave, and
    stores what the database lacks. Restarted at once, twice, the run's stored steps are
    1..max once each on every rank, and every checkpoint on disk has its event."""
    from traind.trainer.checkpoint import list_checkpoints

    sets = (*SETS, "job.nproc_per_node=2", "job.checkpoint_every=1000", "job.keep_last=0")
    d = start_daemon(tmp_path, steps=100_000, sets=sets)
    try:
        run = _wait_step(d, 30)
        for _ in range(2):
            os.kill(d.proc.pid, signal.SIGKILL)  # no handler runs; the ranks get SIGTERM
            d.proc.wait(10)
            d = start_daemon(tmp_path, steps=100_000, sets=sets)  # at once: no waiting here
            # 20 steps past where the killed ranks saved (the summary the restart recovered)
            again = _wait_step(d, _run(d)["summary"]["step"] + 20)
            assert again["id"] == run["id"]
            # Its summary names the checkpoint it trains on from (the stop's, newest on disk;
            # the next periodic one is 1,000 steps away), not an older one.
            newest = list_checkpoints(tmp_path / "var" / "runs" / str(run["id"]))[-1].name
            assert again["summary"]["last_checkpoint"] == newest
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0, d.log.read_text()[-3000:]
        steps, ranks, comm, ckpts = _stored(d, run["id"])
        assert steps == list(range(1, steps[-1] + 1)), [
            s for a, s in itertools.pairwise(steps) if s != a + 1]
        assert sorted(ranks) == [0, 1]
        for rank, seen in ranks.items():
            assert seen == list(range(1, steps[-1] + 1)), rank
        for rank, seen in comm.items():
            assert len(seen) == len(set(seen)), rank  # no report counted twice
        # Three stop checkpoints (two kills and the SIGTERM), each with its event.
        out_dir = tmp_path / "var" / "runs" / str(run["id"])
        on_disk = [int(p.name[5:13]) for p in list_checkpoints(out_dir)]
        assert len(on_disk) == 3 and sorted(set(ckpts)) == on_disk, (on_disk, ckpts)
        final = crud_run(d, run["id"])
        assert final.summary["last_checkpoint"].endswith(f"step_{on_disk[-1]:08d}.pt")
    finally:
        stop_daemon(d)


def crud_run(d: Any, run_id: int) -> Any:
    from traind.daemon.db import crud
    from traind.daemon.db.engine import default_url, make_engine

    return crud.get_run(make_engine(default_url(d.var_dir)), run_id=run_id)


def _experiment(d: Any, exp_id: int) -> dict[str, Any]:
    return d.get(f"/api/experiments/{exp_id}").json()


def _arm_rows(d: Any, run_id: int) -> list[dict[str, Any]]:
    from traind.daemon.db import crud
    from traind.daemon.db.engine import default_url, make_engine

    return crud.run_events(make_engine(default_url(d.var_dir)), run_id=run_id, kind="arm")


def _wait(what: Any, timeout: float, d: Any) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, d.log.read_text()[-3000:]
        time.sleep(0.3)
    return got


def test_an_interleaved_experiment_resumes_with_its_blocks_after_a_sigterm_and_a_sigkill(
        tmp_path: Path) -> None:
    """Issue 40.3: a SIGTERM failed a running interleaved experiment and left its run
    ``preempted`` forever. Now it stays running, its run resumes at the next start with the
    blocks it stored (after a SIGKILL too: the ranks' spool has those the daemon lost), and
    it reaches its verdict from every block, each measured once."""
    sets = ("daemon.default_job=false", "telemetry.every=1")
    d = start_daemon(tmp_path, sets=sets)
    try:
        token = (d.var_dir / "token").read_text().strip()
        # No verdict is possible before 6 pairs (the always-valid test has no bound below;
        # stats.sequence_half_width), 480 steps here: the SIGTERM, a block or so past the
        # first, finds it running. The budget: 24 blocks, 12 pairs.
        created = httpx.post(d.url + "/api/experiments", timeout=30, headers={
            "Authorization": f"Bearer {token}"}, json={
            "name": "resume", "steps": 960, "block_steps": 40, "warmup_steps": 2,
            "min_effect": 0.001, "equivalence": 0.0005,
            "arms": [{"name": "a", "precision": "fp32"}, {"name": "b", "precision": "fp32"}]})
        assert created.status_code == 201, created.text
        exp_id = created.json()["id"]
        run_id = _wait(lambda: _experiment(d, exp_id).get("run_id"), 60, d)
        stored = 0
        for stop in (signal.SIGTERM, signal.SIGKILL):
            _wait(lambda d=d, n=stored: len(_arm_rows(d, run_id)) > n, 120, d)
            d.proc.send_signal(stop)
            d.proc.wait(60)
            if stop == signal.SIGTERM:
                e = _experiment_row(d, exp_id)
                assert e.state == "running", (e.state, e.verdict)  # not failed
                assert crud_run(d, run_id).state == "preempted"
            d = start_daemon(tmp_path, sets=sets)  # at once
            stored = len(_arm_rows(d, run_id))
        found = _wait(lambda: (e := _experiment(d, exp_id))["state"] != "running" and e, 240, d)
        assert found["state"] == "done", found
        (verdict,) = found["verdict"].values()
        rows = _arm_rows(d, run_id)
        # Every block once: none lost to a stop, none measured twice.
        assert sorted(r["data"]["block"] for r in rows) == list(range(len(rows)))
        # The verdict counts every pair up to its decision (the budget's end: all 24
        # blocks; a decision after 6 pairs: those up to it), those of each earlier life too.
        upto = [r for r in rows if r["step"] <= verdict.get("decided_at_step", 960)]
        assert verdict["pairs"] == len(upto) // 2 and len(upto) // 2 > stored // 2, verdict
        if crud_run(d, run_id).state == "completed":
            assert len(rows) == 24 and verdict["pairs"] == 12
    finally:
        stop_daemon(d)


def _experiment_row(d: Any, exp_id: int) -> Any:
    from traind.daemon.db import queue
    from traind.daemon.db.engine import default_url, make_engine

    view = queue.get_experiment(make_engine(default_url(d.var_dir)), experiment_id=exp_id)
    assert view is not None
    return view
