"""Multi-node jobs on a shared queue: each node's daemon claims one node slot and launches it.

A cluster job is an experiment of mode ``multinode`` in the cluster's database with one arm and
``job.nnodes`` trials, one per node slot. A daemon with ``daemon.cluster`` on claims a slot
(the same leased, heartbeated claim as any trial), launches the job's ranks on its node with
its own address (``daemon.node_addr``) and interface (``daemon.node_iface``), and torchrun's
c10d rendezvous at ``job.rdzv_endpoint`` joins the nodes into one job. One slot at a time per
daemon, so two slots of one job never land on the same node. The slot's result is the node's
run: its id there, its end state, its last loss.

A cluster job's ranks on this node share its cores with whatever else the node's scheduler
runs, so it holds one of the node's experiment slots (``experiments/slots.py``) as every
experiment job does: a node busy with an experiment claims no cluster slot until that job
ends, and a node running a cluster slot starts no experiment job beside it. The slot is taken
before the claim, so a claimed node slot's lease never runs out waiting for a local job, and
the nodes that claimed it first are not left waiting at the rendezvous for one that cannot
start. Its waiter goes first (:data:`SLOT_KEY`): other nodes' ranks wait on this one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from traind.contracts.states import TRIAL_ENDED
from traind.daemon.db import queue
from traind.daemon.experiments.lease import LEASE_SECONDS, train_leased
from traind.daemon.service import ShuttingDown
from traind.daemon.tasks import KeyedTasks
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from traind.daemon.config import Settings
    from traind.daemon.experiments.slots import Slots
    from traind.daemon.runs.supervisor import Supervisor

log = logging.getLogger("traind")
MODE = "multinode"
POLL_SECONDS = 2.0
# The cluster loop's place among the node's slot waiters: ahead of every experiment (their
# keys are their ids, from 1), because the cluster job's other nodes wait for this one.
SLOT_KEY = 0


def create_cluster_job(engine: Any, cfg: TrainConfig, *, traind_version: str,
                       torch_version: str, device: str) -> int:
    """Queue ``cfg`` (``job.nnodes`` > 1, ``job.rdzv_endpoint`` set) as one slot per node."""
    if cfg.job.nnodes < 2:
        raise ValueError("job.nnodes: a cluster job has 2 or more nodes")
    return queue.create_experiment(
        engine, name=cfg.job.name, mode=MODE, base_config=cfg.model_dump(mode="json"),
        arms=[{"name": "job", "overrides": {}, "baseline": True}], repeats=cfg.job.nnodes,
        budget={"steps": cfg.job.steps}, traind_version=traind_version,
        torch_version=torch_version, device=device)


def node_config(base: dict[str, Any], node_addr: str | None) -> TrainConfig:
    """The job as this node launches it: the same everywhere (name, rendezvous: they are how
    torchrun matches the nodes) but this node's address, and no folder (the node picks)."""
    cfg = TrainConfig.model_validate(base)
    return cfg.model_copy(update={"job": cfg.job.model_copy(update={
        "local_addr": node_addr, "out_dir": None})})


class SlotRunner:
    def __init__(self, *, engine: Engine, settings: Settings, runs: Supervisor,
                 slots: Slots) -> None:
        """``slots``: the node's experiment slots (a cluster slot's job holds one)."""
        self.engine, self.settings, self.runs, self.slots = engine, settings, runs, slots
        self.owner = f"node:{socket.gethostname()}:{os.getpid()}"
        self._tasks: KeyedTasks[str] = KeyedTasks("cluster")

    def start(self) -> None:
        self._tasks.start("slots", self._loop)

    async def close(self) -> None:
        await self._tasks.close()

    async def _loop(self) -> None:
        while True:
            try:
                async with self.slots.hold(SLOT_KEY):
                    claimed = await asyncio.to_thread(
                        queue.claim, self.engine, owner=self.owner,
                        lease_seconds=LEASE_SECONDS, mode=MODE)
                    if claimed is not None:
                        await self._run(claimed)
                        continue
                await asyncio.sleep(POLL_SECONDS)  # the slot is free for others meanwhile
            except asyncio.CancelledError:
                raise
            except ShuttingDown:  # the claimed slot's lease runs out; another node retakes it
                return
            except Exception:  # a broken database or job: say so, keep serving the node
                log.exception("cluster slot failed")
                await asyncio.sleep(POLL_SECONDS)

    async def _run(self, claimed: queue.ClaimedTrial) -> None:
        engine = self.engine
        view = await asyncio.to_thread(queue.get_experiment, engine,
                                       experiment_id=claimed.experiment_id)
        assert view is not None
        cfg = node_config(view.base_config, self.settings.daemon.node_addr)

        async def started(run_id: int) -> None:
            log.info("cluster job %d: slot %d runs as run %d", view.id, claimed.repeat, run_id)

        run_id, trace = await train_leased(self.runs, engine, cfg, claimed, owner=self.owner,
                                           started=started)
        result = {"run_id": run_id, "node": self.settings.daemon.node_addr,
                  "owner": self.owner, "state": trace.state, "loss": trace.loss}
        if trace.state == "completed":
            await asyncio.to_thread(queue.complete, engine, trial_id=claimed.trial_id,
                                    attempt=claimed.attempt, result=result)
        else:
            await asyncio.to_thread(queue.fail, engine, trial_id=claimed.trial_id,
                                    attempt=claimed.attempt,
                                    error=f"run {run_id} {trace.state}: {trace.error}")
        await asyncio.to_thread(_finish_if_done, engine, view.id)


def _finish_if_done(engine: Any, experiment_id: int) -> None:
    """The last node to finish ends the cluster job (finish_experiment ends it once)."""
    trials = queue.list_trials(engine, experiment_id=experiment_id)
    if all(t.state in TRIAL_ENDED for t in trials):
        ok = all(t.state == "done" for t in trials)
        queue.finish_experiment(engine, experiment_id=experiment_id,
                                state="done" if ok else "failed",
                                verdict={"nodes": [t.result for t in trials]})
