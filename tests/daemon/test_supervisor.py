"""The supervisor's requests to a running job that go through its out_dir."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from traind.contracts.control import PROBE_REQUEST
from traind.daemon.runs.supervisor import Supervisor
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from pathlib import Path


def _job(out_dir: Path, ranks: int, nodes: int = 1) -> SimpleNamespace:  # a running Job's parts
    job = {"nproc_per_node": ranks, "nnodes": nodes}
    if nodes > 1:
        job["rdzv_endpoint"] = "10.0.0.1:29400"
    cfg = TrainConfig.model_validate({"job": job})
    return SimpleNamespace(cfg=cfg, out_dir=out_dir)


def test_a_link_probe_is_asked_of_a_running_multi_rank_job_only(tmp_path: Path) -> None:
    jobs = {1: _job(tmp_path / "one", 1), 2: _job(tmp_path / "two", 2),
            3: _job(tmp_path / "nodes", 1, nodes=2)}
    for job in jobs.values():
        job.out_dir.mkdir()
    sup = SimpleNamespace(jobs=jobs)  # only the running jobs are read

    def ask(run_id: int) -> bool:
        return Supervisor.request_link_probe(sup, run_id)  # type: ignore[arg-type]

    assert ask(2) and (tmp_path / "two" / PROBE_REQUEST).exists()
    assert ask(3)  # one rank per node, two nodes: a link between them
    assert not ask(1) and not (tmp_path / "one" / PROBE_REQUEST).exists()  # no link
    assert not ask(9)  # not running here
