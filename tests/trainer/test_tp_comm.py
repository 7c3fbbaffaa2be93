"""Counting functional collectives at the dispatcher (trainer/tp_comm.py): the scaling is a
table; the counting runs on two real gloo ranks, the collectives DTensor would issue, waited on
both ways (an explicit wait_tensor, and an op reading the pending result)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from traind.trainer.tp_comm import message_bytes, scale_window

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize(("factor", "calls", "nbytes", "seconds", "counts"), [
    (1, 2, 100, 0.5, [1, 1]),
    (5, 10, 500, 2.5, [5, 5]),
])
def test_scale_window(factor: int, calls: int, nbytes: int, seconds: float,
                      counts: list[int]) -> None:
    window = [{"op": "all_gather", "size": "4KiB", "calls": 2, "bytes": 100, "seconds": 0.5,
               "counts": [1, 1]}]
    (got,) = scale_window(window, factor)
    assert (got["op"], got["size"]) == ("all_gather", "4KiB")
    assert (got["calls"], got["bytes"], got["counts"]) == (calls, nbytes, counts)
    assert got["seconds"] == pytest.approx(seconds)


def test_message_bytes_of_a_tensor_and_a_coalesced_list() -> None:
    assert message_bytes(torch.ones(8)) == 32
    assert message_bytes([torch.ones(8), torch.ones(4, dtype=torch.bfloat16)]) == 40


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed._functional_collectives as funcol

    from traind.trainer.collectives import HostClock
    from traind.trainer.tp_comm import MeshCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    assert group is not None
    counted = MeshCollectives({group.group_name: "tp"}, HostClock(), {"tp": 2})
    x = torch.ones(1024)  # 4 KiB
    with counted.recording():
        gathered = funcol.all_gather_tensor(x, 0, group)  # (2048,), pending
        doubled = gathered * 2  # reads it: the wait is inside its own dispatch
        scattered = funcol.reduce_scatter_tensor(doubled, "sum", 0, group)
        total = funcol.all_reduce(scattered, "sum", group).wait()  # an explicit wait
    ignored = MeshCollectives({"another group": "tp"}, HostClock())
    with ignored.recording():
        funcol.all_reduce(x, "sum", group).wait()
    torch.save({"window": counted.take(3), "ignored": ignored.take(),
                "total": total.sum().item()}, f"{out}.{rank}")
    dist.barrier()
    os._exit(0)


def test_two_ranks_count_op_bytes_and_time_per_mesh_dim(tmp_path: Path) -> None:
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    mp.start_processes(_rank, args=(store, out), nprocs=2, start_method="spawn")
    for rank in range(2):
        got: dict[str, Any] = torch.load(f"{out}.{rank}")
        # 2 x the gathered ones, summed over 2 ranks by each of two reductions: 8 a value
        assert got["total"] == 8 * 1024  # the collectives ran as they would uncounted
        window, busy = got["window"]["tp"]
        by_op = {c["op"]: c for c in window}
        assert set(by_op) == {"all_gather", "reduce_scatter", "all_reduce"}
        # three steps' worth of one each; bytes are each rank's input
        assert [by_op[op]["calls"] for op in sorted(by_op)] == [3, 3, 3]
        assert by_op["all_gather"]["bytes"] == 3 * 4096
        assert by_op["reduce_scatter"]["bytes"] == 3 * 8192
        assert by_op["all_reduce"]["bytes"] == 3 * 4096
        assert all(c["seconds"] > 0 and sum(c["counts"]) == 3 for c in window)
        assert busy > 0
        assert got["ignored"] == {"tp": ([], 0.0)}  # another group's: not counted
