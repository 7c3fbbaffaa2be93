import asyncio
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from traind.contracts.events import Event, LifecycleEvent, StepEvent
from traind.daemon.runs.jobs import Job, JobExit, launch_command, root_cause
from traind.metrics.goodput import GoodputFold
from traind.trainer.checkpoint import latest, load_checkpoint
from traind.trainer.config import JobConfig, TrainConfig

RACED = """\
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 31950)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 31949)
"""


def test_launch_command_uses_torchrun_and_the_worker():
    cmd = launch_command(Path("/x/config.json"), "/tmp/s.sock", JobConfig(nproc_per_node=2))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--standalone" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == "traind.trainer.worker"
    assert cmd[-4:] == ["--config", "/x/config.json", "--events", "/tmp/s.sock"]


def test_exit_states_and_descriptions():
    assert JobExit(0, False, "").state == "completed"
    assert JobExit(1, True, "").state == "stopped"
    failed = JobExit(1, False, "Traceback\nValueError: data.paths")
    assert failed.state == "failed"
    assert "exit code 1" in failed.describe() and "data.paths" in failed.describe()
    killed = JobExit(-signal.SIGKILL, False, "")
    assert "SIGKILL" in killed.describe()
    assert JobExit(0, False, "x").describe() is None


def test_multi_node_uses_c10d_rendezvous():
    job = JobConfig(name="big", nnodes=2, nproc_per_node=8, rdzv_endpoint="node0:29400")
    cmd = launch_command(Path("c.json"), None, job)
    assert "--standalone" not in cmd
    assert {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29400",
            "--rdzv_id=traind-big", "--nproc_per_node=8"} <= set(cmd)
    assert "--events" not in cmd


TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
traind.trainer.worker FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3786)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_20:43:25
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 3787)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 3787
======================================================
"""


def test_max_restarts_reaches_torchrun():
    assert "--max_restarts=0" in launch_command(Path("c.json"), None, JobConfig())
    assert "--max_restarts=2" in launch_command(Path("c.json"), None,
                                                JobConfig(max_restarts=2))


def test_a_killed_rank_is_named_with_its_signal():
    assert root_cause(TORCHRUN_SUMMARY) == (1, -9)
    assert root_cause("Traceback\nValueError: x") is None
    # The peer that failed in its next collective may be "first observed": the kill wins.
    assert root_cause(RACED) == (1, -9)
    exit_ = JobExit(1, False, TORCHRUN_SUMMARY)
    assert exit_.state == "failed" and exit_.signal == "SIGKILL"
    assert exit_.describe().startswith(
        "worker rank 1 killed by SIGKILL (launcher exit code 1)\n")
    assert JobExit(-signal.SIGTERM, False, "").signal == "SIGTERM"
    assert JobExit(1, False, "ValueError: x").signal is None
    crashed = JobExit(1, False, TORCHRUN_SUMMARY.replace("-9 (pid", "1 (pid"))
    assert crashed.signal is None and "worker rank 1 exit code 1" in crashed.describe()


# -- real torchrun launches (slow) ---------------------------------------------------------

def _train_config(out_dir: Path, **job: object) -> TrainConfig:
    return TrainConfig.model_validate({
        "job": {"steps": 60, "batch_size": 4, "threads": 1, "out_dir": str(out_dir),
                "eval_every": 10_000, "checkpoint_every": 10, "seed": 3, "device": "cpu",
                "nproc_per_node": 2, **job},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "telemetry": {"per_layer": False},
    })


async def _run_job(cfg: TrainConfig, out_dir: Path, *, kill_at: int | None,
                   stamps: list[float] | None = None) -> tuple[JobExit, list[Event]]:
    """Run the job as the daemon does; SIGKILL one rank once rank 0 reports ``kill_at``.
    ``stamps`` gets the launch's and the end's unix times, as the supervisor takes them."""
    events: list[Event] = []
    job = Job(cfg, out_dir, events.append)
    if stamps is not None:
        stamps.append(time.time())
    await job.start()
    assert job.pid is not None
    if kill_at is not None:
        deadline = time.monotonic() + 120
        while not any(isinstance(e, StepEvent) and e.step >= kill_at for e in events):
            assert time.monotonic() < deadline, job.log_path.read_text()[-3000:]
            await asyncio.sleep(0.05)
        ranks = psutil.Process(job.pid).children()
        assert len(ranks) == 2
        ranks[-1].send_signal(signal.SIGKILL)  # one rank, no goodbye
    exit_ = await asyncio.wait_for(job.wait(), 240)
    if stamps is not None:
        stamps.append(time.time())
    return exit_, events


def _final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    path = latest(out_dir)
    assert path is not None
    return load_checkpoint(path)["model"]


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_onto_the_uninterrupted_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full, _ = asyncio.run(_run_job(_train_config(full_dir), full_dir, kill_at=None))
    assert full.state == "completed", full.log_tail
    stamps: list[float] = []
    # Rank 0 made slow (a sleep, the same arithmetic), so the kill lands a step or two after
    # step 24, between checkpoints: at full speed the ranks once trained on to the checkpoint
    # of step 30 before the signal arrived, and nothing was left to lose.
    monkeypatch.setenv("TRAIND_DEBUG_SLOW_RANK", "0:0.05")
    cut, events = asyncio.run(_run_job(_train_config(cut_dir, max_restarts=1), cut_dir,
                                       kill_at=24, stamps=stamps))
    assert cut.state == "completed", cut.log_tail
    _goodput_counts_the_restart(events, *stamps)
    resumed = [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "resumed"]
    # both ranks of the second attempt, from the last complete checkpoint before the kill
    assert {e.rank for e in resumed} == {0, 1}
    assert len({e.step for e in resumed}) == 1 and 20 <= resumed[0].step < 60
    expected, got = _final_weights(full_dir), _final_weights(cut_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.slow
def test_without_restarts_a_killed_rank_fails_the_job_with_its_signal(tmp_path: Path):
    exit_, _ = asyncio.run(_run_job(_train_config(tmp_path, steps=400), tmp_path, kill_at=3))
    assert exit_.state == "failed" and exit_.code == 1 and exit_.signal == "SIGKILL"
    description = exit_.describe()
    assert description is not None and "killed by SIGKILL" in description


def _goodput_counts_the_restart(events: list[Event], launched: float, ended: float) -> None:
    """Issue 17: the run's goodput, folded from rank 0's real events as the supervisor folds
    them, counts the restart, the restore and the steps redone, and adds up to the wall."""
    fold = GoodputFold(launched=launched)
    for event in events:
        if event.rank == 0:
            fold.observe(event)
    g = fold.account(end=ended)
    assert g.attempts == 2, g
    assert g.wall == pytest.approx(ended - launched)
    assert abs(g.productive + sum(g.badput.values()) - g.wall) < 1.0, g  # within a second
    # rank 0 trained past the checkpoint it went back to: those steps were lost
    resumed = next(e.step for e in events if isinstance(e, LifecycleEvent)
                   and e.phase == "resumed" and e.rank == 0)
    reached = max(e.step for e in events if isinstance(e, StepEvent) and e.rank == 0
                  and e.clock.get("started") == fold.attempts[0].started)
    assert reached > resumed
    assert g.badput["progress_lost"] > 0
    assert g.badput["checkpoint_restore"] > 0 and g.badput["restart"] > 0
    assert g.badput["startup"] > 0 and g.badput["checkpoint_save"] > 0
    assert g.committed == g.productive > 0 and 0 < g.ratio < 1 and g.ratio <= g.ettr
    print(f"goodput of a run killed once: wall {g.wall:.1f} s, productive "
          f"{g.productive:.1f} s ({g.ratio:.0%}), ETTR {g.ettr:.0%}, badput "
          + ", ".join(f"{k} {v:.2f}" for k, v in g.badput.items()))


def test_the_socket_sweep_takes_only_folders_holding_nothing_but_a_dead_socket(
        tmp_path: Path) -> None:
    """What the sweep at a job's start may remove in /tmp: a ``traind-sock-*`` folder with
    nothing in it but a socket nobody listens on. A user's own ``traind-*`` folder (the
    newcomer check's copy of the tree lived in one), a socket folder holding anything else,
    and a live daemon's are left alone."""
    import os
    import socket
    import time

    from traind.daemon.runs.jobs import sweep_stale_sockets

    other = tmp_path / "traind-newcomer.x1"
    other.mkdir()
    (other / "serve.log").write_text("a user's file")
    extra = tmp_path / "traind-sock-extra"
    extra.mkdir()
    (extra / "events.sock").touch()
    (extra / "notes").write_text("not a job's")
    empty = tmp_path / "traind-sock-empty"
    empty.mkdir()
    live = tmp_path / "traind-sock-live"
    live.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(live / "events.sock"))
        server.listen()
        dead = tmp_path / "traind-sock-dead"
        dead.mkdir()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.bind(str(dead / "events.sock"))  # bound, never listening: refuses
        long_ago = time.time() - 600
        for folder in (other, extra, empty, live, dead):
            os.utime(folder, (long_ago, long_ago))
        fresh = tmp_path / "traind-sock-fresh"  # just made: its socket is being bound
        fresh.mkdir()
        removed = sweep_stale_sockets(tmp_path)
    assert sorted(p.name for p in removed) == ["traind-sock-dead", "traind-sock-empty"]
    assert other.is_dir() and extra.is_dir() and live.is_dir() and fresh.is_dir()
