"""The Communication page's history: latency percentiles per op from the ranks' bucket counts,
and the probe's bus bandwidth per message size, in bounded buffers."""

from __future__ import annotations

from typing import Any

import pytest

from traind.contracts.comm import LATENCY_BOUNDS, latency_bin
from traind.contracts.events import CommEvent, ProbeEvent, StepEvent
from traind.daemon.ingest.comm_history import SLOT_SECONDS, CommHistory
from traind.metrics.arithmetic import bucket_quantile, bus_bandwidth


def counts(*latencies: float) -> list[int]:
    out = [0] * (len(LATENCY_BOUNDS) + 1)
    for s in latencies:
        out[latency_bin(s)] += 1
    return out


def comm(rank: int, step: int, t: float, *colls: dict[str, Any]) -> CommEvent:
    return CommEvent(rank=rank, step=step, method="none", steps=1, buckets=1, raw_bytes=1,
                     sent_bytes=1, rel_error=0.0, hook_seconds=0.0, allreduce_seconds=0.0,
                     collectives=list(colls), world_size=2, time=t)


def coll(op: str, size: str, *latencies: float) -> dict[str, Any]:
    return {"op": op, "size": size, "calls": len(latencies), "bytes": 1,
            "seconds": sum(latencies), "counts": counts(*latencies)}


def probe(rank: int, step: int, seconds: list[float], t: float = 100.0) -> ProbeEvent:
    return ProbeEvent(rank=rank, step=step, op="all_reduce", world_size=2,
                      sizes=[4096, 1 << 20], seconds=seconds, time=t)


def test_ranks_and_sizes_of_one_slot_fold_into_one_point_per_op() -> None:
    h = CommHistory()
    t = 1000 * SLOT_SECONDS
    h(3, comm(0, 10, t, coll("all_reduce", "64KiB", 2e-4, 2e-4), coll("all_reduce", "1MiB", 2e-3)))
    h(3, comm(1, 10, t + 0.2, coll("all_reduce", "64KiB", 2e-4)))
    h(3, comm(0, 20, t + SLOT_SECONDS, coll("all_reduce", "64KiB", 5e-5),
              coll("all_gather", "4KiB", 2e-5)))
    snap = h.snapshot()
    assert snap["run"] == 3
    ops = {e["op"]: e for e in snap["latency"]}
    ar = ops["all_reduce"]
    assert ar["calls"] == [4, 1] and ar["step"] == [10, 20] and ar["time"] == [t + 0.2,
                                                                                t + SLOT_SECONDS]
    # The percentiles are those of the merged buckets (3 in (1e-4, 3e-4], 1 in (1e-3, 3e-3]).
    merged = counts(2e-4, 2e-4, 2e-4, 2e-3)
    assert ar["p50"][0] == pytest.approx(bucket_quantile(0.5, LATENCY_BOUNDS, merged))
    assert ar["p99"][0] == pytest.approx(bucket_quantile(0.99, LATENCY_BOUNDS, merged))
    assert 1e-4 < ar["p50"][0] <= 3e-4 < 1e-3 < ar["p99"][0] <= 3e-3
    assert ops["all_gather"]["calls"] == [1]


def test_a_late_rank_lands_in_the_newest_slot_and_the_buffer_is_bounded() -> None:
    h = CommHistory(slots=3)
    for i in range(5):
        h(1, comm(0, i, (100 + i) * SLOT_SECONDS, coll("all_reduce", "4KiB", 1e-4)))
    # Rank 1's report of step 0 arrives last: its slot is long gone.
    h(1, comm(1, 0, 100 * SLOT_SECONDS + 0.1, coll("all_reduce", "4KiB", 1e-4)))
    ar = h.snapshot(1)["latency"][0]
    assert ar["step"] == [2, 3, 4] and ar["calls"] == [1, 1, 2]


def test_the_probe_keeps_the_slowest_rank_and_the_catalog_bus_bandwidth() -> None:
    h = CommHistory(probes=2)
    h(2, probe(0, 50, [1e-4, 1e-3]))
    h(2, probe(1, 50, [2e-4, 1e-3]))
    h(2, probe(0, 100, [1e-4, 5e-4], t=200.0))
    h(2, probe(0, 150, [1e-4, 5e-4], t=300.0))  # the oldest probe leaves
    by_size = {p["size_bytes"]: p for p in h.snapshot(2)["probe"]}
    small = by_size[4096]
    assert small["step"] == [100, 150] and small["latency"] == [1e-4, 1e-4]
    assert small["bus_bandwidth"] == [bus_bandwidth(4096, 1e-4, 2, "all_reduce")] * 2
    h2 = CommHistory()
    h2(2, probe(0, 50, [1e-4, 1e-3]))
    h2(2, probe(1, 50, [2e-4, 1e-3]))
    assert h2.snapshot(2)["probe"][0]["latency"] == [2e-4]  # the slower rank's


def test_other_events_are_ignored_and_a_forgotten_run_leaves() -> None:
    h = CommHistory()
    h(1, StepEvent(rank=0, step=1, loss=1.0, lr=0.1, grad_norm=1.0, tokens=1, step_seconds=1,
                   data_seconds=0, forward_seconds=0, backward_seconds=0, optimizer_seconds=0))
    assert h.snapshot() == {"run": None, "runs": [], "slot_seconds": SLOT_SECONDS,
                            "latency": [], "probe": [], "mesh": None}
    h(1, probe(0, 5, [1e-4, 1e-3]))
    h(4, comm(0, 1, 5.0, coll("all_reduce", "4KiB", 1e-4)))
    assert h.snapshot()["run"] == 4 and h.runs() == [4, 1]
    assert h.snapshot(1)["probe"] and not h.snapshot(1)["latency"]
    h.forget(4)
    assert h.runs() == [1] and h.snapshot(4)["latency"] == []


def test_the_probe_setting_the_page_names_is_the_config_field_and_off_by_default() -> None:
    from traind.daemon.config import load_settings
    from traind.daemon.service import PROBE_SETTING

    assert PROBE_SETTING.path == "telemetry.probe_every" and PROBE_SETTING.default == 0
    assert "probe" in PROBE_SETTING.description
    assert PROBE_SETTING.env == "TRAIND_TELEMETRY__PROBE_EVERY"
    # The example the page gives is a value the config accepts, set the way the page says.
    assert load_settings(None, env={}).telemetry.probe_every == 0
    on = load_settings(None, env={PROBE_SETTING.env: str(PROBE_SETTING.example)})
    assert on.telemetry.probe_every == PROBE_SETTING.example > 0
    via_set = load_settings(None, env={},
                           overrides=[f"{PROBE_SETTING.path}={PROBE_SETTING.example}"])
    assert via_set.telemetry.probe_every == PROBE_SETTING.example


def test_a_tp_x_pp_runs_mesh_ranks_bytes_and_time_per_dim_and_bubble_per_stage() -> None:
    import dataclasses

    from traind.contracts.events import LifecycleEvent, PipelineEvent

    h = CommHistory()
    for rank in range(4):  # tp2 x pp2: ranks 0, 1 are stage 0's tp pair, 2, 3 stage 1's
        h(5, LifecycleEvent(rank=rank, phase="started", step=0,
                            detail={"mesh": {"dp": 1, "tp": 2, "pp": 2}}))
        tp = dataclasses.replace(comm(rank, 4, 100.0, coll("all_gather", "4KiB", 1e-4, 1e-4)),
                                 mesh_dim="tp", steps=2, allreduce_seconds=0.002)
        h(5, tp)
        stage = rank // 2
        p2p = [{"direction": "forward", "op": "send" if stage == 0 else "recv", "calls": 2,
                "bytes": 1000, "seconds": 0.001},
               {"direction": "backward", "op": "recv" if stage == 0 else "send", "calls": 2,
                "bytes": 1000, "seconds": 0.003}]
        h(5, PipelineEvent(rank=rank, step=4, stage=stage, stages=2, microbatches=2,
                           schedule="1f1b", busy_seconds=0.1, idle_seconds=0.1 * (1 + stage),
                           bubble=0.2 + 0.2 * stage, bubble_theory=1 / 3, p2p=p2p))
    snap = h.snapshot(5)
    assert [line["op"] for line in snap["latency"]] == ["all_gather (tp)"]
    mesh = snap["mesh"]
    assert mesh["shape"] == {"dp": 1, "tp": 2, "pp": 2}
    assert [(r["rank"], r["dp"], r["tp"], r["pp"]) for r in mesh["ranks"]] == [
        (0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 0, 1), (3, 0, 1, 1)]
    dims = {d["mesh_dim"]: d for d in mesh["dims"]}
    assert list(dims) == ["tp", "pp"]
    # per rank and step: 2 calls (1 byte in all) over 2 steps; 2 ms of busy time over 2
    assert dims["tp"]["bytes_per_step"] == 0.5 and dims["tp"]["calls_per_step"] == 1.0
    assert dims["tp"]["seconds_per_step"] == pytest.approx(1e-3)
    # each rank sends 1000 bytes a step (forward on stage 0, backward on stage 1), and waits
    # 4 ms on its sends and receives
    assert dims["pp"]["bytes_per_step"] == 1000
    assert dims["pp"]["seconds_per_step"] == pytest.approx(0.004)
    stages = {s["stage"]: s for s in mesh["stages"]}
    assert stages[1]["ranks"] == [2, 3] and stages[1]["bubble"] == pytest.approx(0.4)
    assert stages[0]["sent_forward_bytes"] == 1000 and stages[0]["sent_backward_bytes"] == 0
    assert stages[1]["sent_backward_bytes"] == 1000


def test_a_dp_only_run_has_no_mesh_section() -> None:
    from traind.contracts.events import LifecycleEvent

    h = CommHistory()
    h(6, LifecycleEvent(rank=0, phase="started", step=0,
                        detail={"mesh": {"dp": 2, "tp": 1, "pp": 1}}))
    h(6, comm(0, 1, 100.0, coll("all_reduce", "4KiB", 1e-4)))
    assert h.snapshot(6)["mesh"] is None
    assert h.snapshot(6)["latency"][0]["op"] == "all_reduce"


def test_a_placed_mesh_shows_each_rank_where_its_started_event_says() -> None:
    """parallel.placement = auto lays ranks out in a measured order: rank 1 may hold stage 1."""
    from traind.contracts.events import LifecycleEvent

    h = CommHistory()
    order = [0, 2, 1, 3]  # slot -> rank: ranks 0, 2 form stage 0's tp pair
    for slot, rank in enumerate(order):
        h(7, LifecycleEvent(rank=rank, phase="started", step=0, detail={
            "mesh": {"dp": 1, "tp": 2, "pp": 2}, "placement": "auto", "rank_order": order,
            "coordinates": {"dp": 0, "tp": slot % 2, "pp": slot // 2}}))
    ranks = h.snapshot(7)["mesh"]["ranks"]
    assert [(r["rank"], r["tp"], r["pp"]) for r in ranks] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
