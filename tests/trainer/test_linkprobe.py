"""The link probe on four real gloo ranks under torchrun (one node: loopback), with
``parallel.placement = "auto"``: the matrix every pair measured reaches the daemon's event
stream from rank 0, placement reads it, and each rank's started event says where it sits.
The two-node case, where placement moves ranks, is tests/e2e/test_placement_netns.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from tests.trainer.mesh_runs import config, run_ranks
from traind.contracts.events import LifecycleEvent, LinkEvent, StepEvent
from traind.trainer.config import ParallelConfig
from traind.trainer.distributed import DistInfo
from traind.trainer.linkprobe import place
from traind.trainer.mesh import MeshShape
from traind.trainer.placement import rank_order

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


def test_four_ranks_probe_every_link_and_place_the_mesh_from_it(tmp_path: Path) -> None:
    cfg = config(tmp_path, batch=4, ranks=4, steps=2,
                 parallel={"dp": 2, "tp": 2, "placement": "auto"})
    events = run_ranks(tmp_path, cfg, 4)
    links = [e for evs in events for e in evs if isinstance(e, LinkEvent)]
    assert [e.rank for e in links] == [0]  # rank 0 speaks for the matrix every rank holds
    link = links[0]
    assert link.placement == "auto" and link.bandwidth_bytes == 1 << 20
    for src in range(4):
        assert link.latency[src][src] == link.bandwidth[src][src] == 0.0
        for dst in set(range(4)) - {src}:
            # loopback gloo: tens of µs and hundreds of MB/s at least, on a loaded machine
            assert 0 < link.latency[src][dst] < 0.05, link.latency
            assert link.bandwidth[src][dst] > 20e6, link.bandwidth
    assert 0 < link.seconds < 2.0  # bounded: three rounds of pairs on loopback
    # the order is placement's of exactly this matrix (the same on every rank)
    assert link.order == rank_order(link.latency, link.bandwidth, MeshShape(dp=2, tp=2))
    for rank, evs in enumerate(events):
        started = next(e for e in evs if isinstance(e, LifecycleEvent)
                       and e.phase == "started")
        assert started.detail["placement"] == "auto"
        assert started.detail["rank_order"] == link.order
        slot = link.order.index(rank)
        assert started.detail["coordinates"] == {"pp": 0, "dp": slot // 2, "tp": slot % 2}
        assert max(e.step for e in evs if isinstance(e, StepEvent)) == 2


def test_fixed_placement_probes_only_when_asked() -> None:
    # no process group here: a probe would raise, so none ran
    info = DistInfo(rank=1, local_rank=1, world_size=4, device=torch.device("cpu"),
                    owns_group=False)
    sent: list[object] = []
    order = place(ParallelConfig(tp=2), MeshShape(dp=2, tp=2), info, sent.append)
    assert order == [0, 1, 2, 3] and sent == []
    with pytest.raises(ValueError, match="process group"):
        place(ParallelConfig(tp=2, link_probe=True), MeshShape(dp=2, tp=2), info, sent.append)


def test_a_running_job_probes_again_when_the_daemon_asks(tmp_path: Path) -> None:
    """The request file (what ``POST /api/runs/{id}/probe-links`` creates) is taken at the
    first report step: every rank probes, rank 0 sends the matrix at that step and removes
    the request, so the job probes once, not at every step."""
    from traind.contracts.control import PROBE_REQUEST

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / PROBE_REQUEST).touch()  # asked before the first step
    cfg = config(tmp_path, batch=4, ranks=2, steps=3)  # placement fixed, no probe at start
    events = run_ranks(tmp_path, cfg, 2)
    links = [e for evs in events for e in evs if isinstance(e, LinkEvent)]
    assert [(e.rank, e.step) for e in links] == [(0, 1)]
    assert links[0].placement == "fixed" and links[0].order == [0, 1]
    assert links[0].bandwidth[0][1] > 0 and links[0].bandwidth[1][0] > 0
    assert not (tmp_path / PROBE_REQUEST).exists()
    assert [max(e.step for e in evs if isinstance(e, StepEvent)) for evs in events] == [3, 3]
