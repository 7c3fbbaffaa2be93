import signal
from pathlib import Path

from traind.daemon.jobs import JobExit, launch_command
from traind.trainer.config import JobConfig


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
