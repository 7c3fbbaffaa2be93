"""`traind serve` as a user runs it: a subprocess on a free port, trained and scraped."""

from __future__ import annotations

import csv
import io
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def scrape(daemon) -> dict[str, list]:
    r = daemon.get("/metrics")
    assert r.status_code == 200
    families = {}
    for fam in text_string_to_metric_families(r.text):
        families[fam.name] = fam.samples
    return families


def value(families: dict, name: str, **labels: str) -> float | None:
    samples = [s for fam in families.values() for s in fam]
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def test_metrics_parse_and_loss_falls_over_50_steps(fresh_daemon):
    daemon = fresh_daemon
    losses: dict[int, float] = {}
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        fams = scrape(daemon)
        step, loss = value(fams, "traind_train_step"), value(fams, "traind_train_loss")
        if step is not None and loss is not None:
            losses[int(step)] = loss
        if losses and max(losses) - min(losses) >= 50 and len(losses) >= 3:
            break
        time.sleep(0.2)
    assert losses, f"no training metrics appeared:\n{daemon.log.read_text()[-3000:]}"
    first, last = min(losses), max(losses)
    assert last - first >= 50, f"only saw steps {first}..{last}"
    # The loss falls: judged on the run's stored steps (every step, as the run page reads
    # them), the first ten against the last ten. A few scraped steps are single batches,
    # too noisy to compare when a loaded machine spaces the scrapes out (seen in CI).
    time.sleep(1.5)  # a flush: the steps scraped are stored
    rows = list(csv.DictReader(io.StringIO(daemon.get("/api/runs/1/series.csv").text)))
    stored = [float(r["loss"]) for r in rows if r["loss"]]
    assert len(stored) >= 50, f"{len(stored)} steps stored"
    head, tail = sum(stored[:10]) / 10, sum(stored[-10:]) / 10
    assert tail < head - 0.3, f"loss did not fall: first ten {head:.3f}, last ten {tail:.3f}"
    assert int(rows[-1]["step"]) >= last - 5  # the store keeps up with the scrapes

    fams = scrape(daemon)
    for name in ("traind_learning_rate", "traind_grad_norm", "traind_train_tokens_per_second",
                 "traind_host_memory_used_bytes", "traind_process_resident_memory_bytes",
                 "traind_process_cpu_seconds", "traind_host_cpu_seconds"):
        assert name in fams or name.removesuffix("_seconds") in fams, name
    assert value(fams, "traind_train_tokens_total", run="1", rank="0") > 0
    phases = {s.labels["phase"] for s in fams["traind_step_phase_duration_seconds"]
              if "phase" in s.labels}
    assert phases == {"data", "forward", "backward", "optimizer"}
    roles = {s.labels["role"] for s in fams["traind_process_resident_memory_bytes"]}
    assert roles == {"daemon", "worker"}
    assert value(fams, "traind_host_collector_success") == 1.0


def test_runs_api_shows_the_running_default_job(daemon):
    runs = daemon.get("/api/runs").json()
    run = runs[0] if isinstance(runs, list) else runs["runs"][0]
    assert run["name"] == "e2e"
    assert run["state"] in ("running", "completed")


def test_validation_loss_reaches_metrics(daemon):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if value(scrape(daemon), "traind_validation_loss", run="1", rank="0") is not None:
            return
        time.sleep(1)
    pytest.fail("no validation loss within 120 s")


def _worker_pids(daemon) -> set[int]:
    return {int(s.labels["pid"]) for s in scrape(daemon)["traind_process_resident_memory_bytes"]
            if s.labels["role"] == "worker"}


def test_sigterm_stops_the_job_and_leaves_no_worker(fresh_daemon):
    import psutil
    from sqlalchemy import create_engine, text

    deadline = time.monotonic() + 60
    while not (pids := _worker_pids(fresh_daemon)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids, "no worker appeared"
    launcher = psutil.Process(min(pids))
    ranks = launcher.children(recursive=True)
    fresh_daemon.proc.terminate()
    assert fresh_daemon.proc.wait(60) == 0
    _, alive = psutil.wait_procs([launcher, *ranks], timeout=10)
    assert not alive, f"workers outlived the daemon: {alive}"
    engine = create_engine(f"sqlite:///{fresh_daemon.var_dir / 'traind.db'}")
    with engine.connect() as conn:
        state = conn.execute(text("SELECT state FROM runs WHERE id = 1")).scalar()
    # Every rank saved at the step they stopped at: preempted, resumed at the next start
    # (tests/e2e/test_preemption.py); completed if it got to the end first.
    assert state in ("preempted", "completed")


def test_a_killed_daemon_does_not_leave_orphan_workers(fresh_daemon):
    import psutil

    deadline = time.monotonic() + 60
    while not (pids := _worker_pids(fresh_daemon)) and time.monotonic() < deadline:
        time.sleep(0.2)
    launcher = psutil.Process(min(pids))
    ranks = launcher.children(recursive=True)
    fresh_daemon.proc.kill()
    fresh_daemon.proc.wait()
    _, alive = psutil.wait_procs([launcher, *ranks], timeout=40)
    assert not alive, f"workers outlived a killed daemon: {alive}"


def test_a_killed_daemon_s_socket_folder_goes_at_the_next_job_start(daemon_factory, tmp_path):
    """Issue 40: every SIGKILLed daemon left its job's event-socket folder in /tmp. The
    next job started on the host removes it (nobody listens there any more)."""
    from pathlib import Path

    import psutil

    from traind.daemon.runs.jobs import STALE_SOCKET_SECONDS

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = daemon_factory(tmp_path / "a")
    deadline = time.monotonic() + 60
    while not (pids := _worker_pids(first)) and time.monotonic() < deadline:
        time.sleep(0.2)
    launcher = psutil.Process(min(pids))
    cmd = launcher.cmdline()
    folder = Path(cmd[cmd.index("--events") + 1]).parent
    assert folder.name.startswith("traind-sock-") and folder.is_dir()
    first.proc.kill()  # SIGKILL: no clean-up runs in the daemon
    first.proc.wait()
    psutil.wait_procs([launcher], timeout=40)
    assert folder.is_dir()  # what the kill leaves
    # stale only once nobody listens and it is older than a folder about to be bound
    time.sleep(max(0.0, STALE_SOCKET_SECONDS + 1 - (time.time() - folder.stat().st_mtime)))
    second = daemon_factory(tmp_path / "b")
    deadline = time.monotonic() + 60
    while not _worker_pids(second) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folder.exists(), "the killed daemon's socket folder is still there"


def test_the_shared_job_is_stopped_while_no_test_looks(_shared_daemon):
    # Between the tests that use it, the shared daemon's worker must not train: on a 2-core
    # machine it would slow every later test (and make timing-sensitive ones flaky).
    import psutil

    from tests.conftest import job_workers

    workers = job_workers(_shared_daemon)
    assert workers, "the shared daemon has no worker"
    assert {w.status() for w in workers} == {psutil.STATUS_STOPPED}


def test_the_token_is_never_logged_and_the_login_link_is_private(daemon):
    token = (daemon.var_dir / "token").read_text().strip()
    log = daemon.log.read_text()
    assert token and token not in log
    assert "login-url" in log  # what is printed instead: where the one-time link is
    link = daemon.var_dir / "login-url"
    assert link.stat().st_mode & 0o777 == 0o600
    assert token not in link.read_text()


def test_a_killed_daemon_takes_a_four_rank_job_with_it(tmp_path):
    # SIGKILL (the OOM killer's signal): no handler runs in the daemon, so the job's launcher
    # and every rank must notice on their own, within seconds.
    import psutil

    from tests.conftest import job_workers, start_daemon, stop_daemon

    d = start_daemon(tmp_path, steps=100_000, sets=("job.nproc_per_node=4",
                                                     "daemon.oversubscribe=true"))
    try:
        deadline = time.monotonic() + 90
        while len(job_workers(d)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        job = psutil.Process(d.proc.pid).children(recursive=True)
        assert len(job_workers(d)) == 4, job
        d.proc.kill()
        d.proc.wait()
        killed = time.monotonic()
        _, alive = psutil.wait_procs(job, timeout=30)
        took = time.monotonic() - killed
        assert not alive, f"outlived a killed daemon by 30 s: {alive}"
        print(f"the job's {len(job)} processes were gone {took:.1f} s after the daemon")
        assert took < 15, took  # graceful (a checkpoint on the way out), on a loaded machine too
    finally:
        stop_daemon(d)


def test_serve_without_a_config_trains_the_shipped_job_on_every_rank_and_page(tmp_path):
    # The newcomer's `make serve`: no config file, so the shipped job runs two gloo ranks where
    # the node has the CPUs (daemon/admission.py shipped_job), and the Communication page has
    # every rank's gradient traffic to show; SIGTERM still ends the run preempted.
    import os
    import signal
    import subprocess
    import sys

    from sqlalchemy import create_engine, text

    from tests.conftest import DaemonProc, free_port, stop_daemon
    from traind.daemon.admission import resources, shipped_ranks
    from traind.trainer.config import JobConfig

    ranks = shipped_ranks(JobConfig(), resources())
    port, log = free_port(), tmp_path / "daemon.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "traind.cli.main", "serve", "--port", str(port),
         "--var-dir", str(tmp_path / "var")], cwd=tmp_path, stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    d = DaemonProc(url=f"http://127.0.0.1:{port}", port=port, var_dir=tmp_path / "var",
                   proc=proc, log=log)
    try:
        deadline, fams = time.monotonic() + 240, {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"traind serve exited:\n{log.read_text()[-3000:]}"
            try:
                fams = scrape(d)
            except Exception:  # not listening yet
                fams = {}
            if all(value(fams, "traind_train_steps_total", run="1", rank=str(r))
                   for r in range(ranks)):
                break
            time.sleep(0.5)
        for r in range(ranks):
            assert value(fams, "traind_train_steps_total", run="1", rank=str(r)), (
                f"rank {r} of {ranks} never stepped:\n{log.read_text()[-3000:]}")
        assert value(fams, "traind_train_loss", run="1", rank=str(ranks)) is None  # no more
        if ranks >= 2:
            for r in range(ranks):
                assert value(fams, "traind_comm_sent_bytes_total", run="1", rank=str(r))
            page = d.get("/comm?fragment=1").text
            assert 'id="comm-table"' in page and 'id="no-comm"' not in page, page[:2000]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        engine = create_engine(f"sqlite:///{tmp_path / 'var' / 'traind.db'}")
        with engine.connect() as conn:
            state = conn.execute(text("SELECT state FROM runs WHERE id = 1")).scalar()
        assert state == "preempted"
    finally:
        stop_daemon(d)
