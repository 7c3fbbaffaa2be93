import signal
from pathlib import Path

from traind.daemon.jobs import JobExit, launch_command


def test_launch_command_uses_torchrun_and_the_worker():
    cmd = launch_command(Path("/x/config.json"), "/tmp/s.sock", 2)
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
