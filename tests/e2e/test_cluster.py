"""A cluster of two daemons, each on its own "node" (a network namespace with its own
address), sharing one queue in a real PostgreSQL: a 2-node job is claimed slot by slot and
joined by torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.conftest import require_real_part
from traind.daemon.db import crud, queue
from traind.daemon.db.engine import make_engine
from traind.daemon.db.migrate import upgrade
from traind.daemon.experiments.cluster import create_cluster_job
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from tests.postgres import PostgresServer

pytestmark = pytest.mark.slow
BENCH = Path(__file__).parents[2] / "bench"


def test_two_daemons_run_one_two_node_job(tmp_path: Path, postgres_server: PostgresServer,
                                          fresh_postgres_url: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    require_real_part("ip", "apt-get install iproute2")
    sys.path.insert(0, str(BENCH))
    from netns import SUBNET, two_nodes

    # One PostgreSQL database for the cluster, as in production. The daemons in their
    # namespaces reach it through its socket file (127.0.0.1 is each namespace's own).
    url = postgres_server.socket_url
    upgrade(url)
    engine = make_engine(url)
    cfg = TrainConfig.model_validate({
        "job": {"name": "two-nodes", "steps": 12, "nnodes": 2, "nproc_per_node": 1,
                "rdzv_endpoint": f"{SUBNET}.1:29611", "batch_size": 4, "eval_every": 1000,
                "checkpoint_every": 1000, "threads": 1},
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 200_000}, "telemetry": {"every": 1}})
    exp = create_cluster_job(engine, cfg, traind_version="test",
                             torch_version=torch.__version__, device="cpu")
    logs = []
    with two_nodes(str(os.getpid() % 10000)) as (ns_a, ns_b, dev_a, dev_b):
        procs = []
        for ns, dev, host in ((ns_a, dev_a, 1), (ns_b, dev_b, 2)):
            log = tmp_path / f"daemon-{host}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "traind.cli.main",
                     "serve", "--no-default-job", "--var-dir", str(tmp_path / f"var{host}"),
                     "--set", f"daemon.db_url={url}", "--set", "daemon.cluster=true",
                     "--set", f"daemon.node_addr={SUBNET}.{host}",
                     "--set", f"daemon.node_iface={dev}"],
                    stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                view = queue.get_experiment(engine, experiment_id=exp)
                if view is not None and view.state in ("done", "failed"):
                    break
                assert all(p.poll() is None for p in procs), _tails(logs)
                time.sleep(1)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
    view = queue.get_experiment(engine, experiment_id=exp)
    assert view is not None and view.state == "done", (view, _tails(logs))
    trials = queue.list_trials(engine, experiment_id=exp)
    assert sorted(t.result["node"] for t in trials) == [f"{SUBNET}.1", f"{SUBNET}.2"]
    runs = crud.list_runs(engine)
    assert len(runs) == 2 and {r.state for r in runs} == {"completed"}, runs
    # One job of two ranks, one on each node, trained to the end.
    assert all(r.summary["world_size"] == 2 and r.summary["step"] == 12 for r in runs)


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
