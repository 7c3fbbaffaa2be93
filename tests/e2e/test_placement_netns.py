"""Topology-aware placement across two "nodes" (network namespaces joined by a veth pair,
shaped by tc: bench/netns.py, as the multi-node test uses): a 4-rank dp2 x tp2 job with
``parallel.placement = "auto"`` probes the links and keeps each tp pair inside a node, and
the placed mesh trains as one rank on the whole batch does.

The ranks are numbered across the nodes on purpose (node a holds ranks 0 and 2, node b 1 and
3: four torchrun agents of one rank each, static rendezvous with given node ranks), so the
fixed layout's tp pairs (0, 1) and (2, 3) would each straddle the slow link: only the
measured matrix can put them right."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, require_real_part
from tests.trainer.mesh_runs import config
from traind.contracts.events import LifecycleEvent, LinkEvent, StepEvent, decode_complete
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import ListSink

pytestmark = pytest.mark.slow
BENCH = Path(__file__).parents[2] / "bench"
RATE = "100mbit"  # between the nodes: a MiB in 84 ms, the probe's slow-link path
NODE_OF_RANK = {0: "a", 1: "b", 2: "a", 3: "b"}
STEPS = 3


def run_two_nodes(tmp: Path, cfg: dict[str, Any]) -> list[list[Any]]:
    sys.path.insert(0, str(BENCH))
    try:
        from netns import SUBNET, shape, two_nodes  # bench/netns.py
    finally:
        sys.path.remove(str(BENCH))
    port = free_port()
    # the static rendezvous's store is on node a; the config says so as a multi-node job must
    cfg["job"].update(nnodes=4, nproc_per_node=1, rdzv_endpoint=f"{SUBNET}.1:{port}")
    (tmp / "config.json").write_text(json.dumps(cfg))
    with two_nodes(str(os.getpid() % 10000)) as (ns_a, ns_b, dev_a, dev_b):
        shape(ns_a, dev_a, RATE)
        shape(ns_b, dev_b, RATE)
        where = {"a": (ns_a, dev_a), "b": (ns_b, dev_b)}
        procs = []
        for rank, node in NODE_OF_RANK.items():
            ns, dev = where[node]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1"}
            # one rank per agent and a static rendezvous: --node_rank is the global rank
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   "--nnodes=4", "--nproc_per_node=1", f"--node_rank={rank}",
                   f"--master_addr={SUBNET}.1", f"--master_port={port}", "--max_restarts=0",
                   "-m", "traind.trainer.worker", "--config", str(tmp / "config.json"),
                   "--events-file", str(tmp / f"events.{rank}")]
            log = open(tmp / f"log.{rank}", "wb")  # noqa: SIM115  # closed with the process
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        try:
            codes = [p.wait(240) for p, _ in procs]
        finally:
            for p, log in procs:
                if p.poll() is None:  # never leave a hung job behind the suite
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                log.close()
    logs = "\n".join((tmp / f"log.{r}").read_text()[-1500:] for r in NODE_OF_RANK)
    assert codes == [0] * 4, logs
    return [decode_complete((tmp / f"events.{r}.rank{r}").read_bytes()) for r in NODE_OF_RANK]


def test_auto_placement_keeps_each_tp_pair_inside_a_node(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and tc need root")
    require_real_part("ip", "apt-get install iproute2")
    require_real_part("tc", "apt-get install iproute2")
    cfg = config(tmp_path / "out", batch=4, steps=STEPS,
                 parallel={"dp": 2, "tp": 2, "placement": "auto"})
    events = run_two_nodes(tmp_path, cfg)

    link = next(e for e in events[0] if isinstance(e, LinkEvent))
    bw = link.bandwidth
    inside = [bw[s][d] for s in range(4) for d in range(4)
              if s != d and NODE_OF_RANK[s] == NODE_OF_RANK[d]]
    across = [bw[s][d] for s in range(4) for d in range(4)
              if NODE_OF_RANK[s] != NODE_OF_RANK[d]]
    # the probe saw the shaped link: 100 Mbit/s is 12.5 MB/s (tbf's 512 kB burst lets a
    # 1 MiB message through faster), loopback 0.3-4.6 GB/s here
    assert max(across) < 80e6 and 3 * max(across) < min(inside), bw
    assert link.seconds < 5.0, link.seconds  # bounded, over a slow link too

    # the fixed order would pair (0, 1) and (2, 3) across the link; auto pairs each node
    assert link.order == [0, 2, 1, 3]
    coords = {}
    for rank, evs in enumerate(events):
        started = next(e for e in evs if isinstance(e, LifecycleEvent) and e.phase == "started")
        assert started.detail["rank_order"] == link.order
        coords[rank] = started.detail["coordinates"]
    tp_pairs: dict[int, set[int]] = {}
    for rank, c in coords.items():
        tp_pairs.setdefault(c["dp"], set()).add(rank)
    assert sorted(coords[r]["tp"] for r in tp_pairs[0]) == [0, 1]
    for pair in tp_pairs.values():
        assert len(pair) == 2 and len({NODE_OF_RANK[r] for r in pair}) == 1, coords

    # and it trained: a tp pair reads one batch and reports one loss, the dp groups differ
    losses = {r: [e.loss for e in evs if isinstance(e, StepEvent)]
              for r, evs in enumerate(events)}
    assert all(len(v) == STEPS for v in losses.values())
    for pair in tp_pairs.values():
        a, b = sorted(pair)
        assert losses[a] == losses[b]
    # the placed mesh trains as one rank on the whole batch (the dp groups' mean loss):
    # coordinates, data shards and sub-meshes all follow the order
    sink = ListSink()
    train(TrainConfig.model_validate(config(tmp_path / "one", batch=8, steps=STEPS)), sink)
    reference = [e.loss for e in sink.events if isinstance(e, StepEvent)]
    mean = [(losses[min(tp_pairs[0])][i] + losses[min(tp_pairs[1])][i]) / 2
            for i in range(STEPS)]
    assert mean == pytest.approx(reference, rel=1e-5)
