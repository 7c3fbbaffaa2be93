"""Communication and hardware over time: the chart specs built from the daemon's history
(pure), and the JSON API that serves that history (documented in OpenAPI)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from fastapi.testclient import TestClient

from traind.daemon.ingest.comm_history import CommHistory
from traind.daemon.ingest.hardware_history import HardwareHistory
from traind.daemon.service import GPU_SETTING, PROBE_SETTING
from traind.web.app import create_app as _create_app
from traind.web.historyviews import comm_history_view, hardware_history_view

GiB = 2**30
create_app = partial(_create_app, allowed_hosts=["testserver"])  # TestClient's Host


def test_comm_view_charts_each_op_busiest_first_and_the_probe_per_size(
        service: Any) -> None:
    v = comm_history_view(service.comm_history())
    assert v.run == 3 and v.probe_off is None
    assert [c.key for c in v.charts] == ["latency-all_reduce", "latency-all_gather",
                                         "probe-busbw"]
    lat = v.charts[0]
    assert lat.log and lat.unit == "latency (ms)"
    assert [t["name"] for t in lat.traces] == ["p50", "p95", "p99"]
    snap = service.comm_history()["latency"]
    ar = next(e for e in snap if e["op"] == "all_reduce")
    assert lat.traces[1]["y"][0] == pytest.approx(ar["p95"][0] * 1e3)  # seconds -> ms
    assert lat.traces[0]["t"] == ar["time"]
    busbw = v.charts[2]
    assert [t["name"] for t in busbw.traces][:2] == ["4 KiB", "16 KiB"]  # one op: sizes name it
    probe = service.comm_history()["probe"][0]
    assert busbw.traces[0]["y"] == [b / GiB for b in probe["bus_bandwidth"]]
    assert busbw.spec == {"key": "probe-busbw", "unit": "bus bandwidth (GiB/s)", "log": False,
                          "traces": list(busbw.traces)}


def test_comm_view_without_a_probe_names_its_setting() -> None:
    h = CommHistory()
    v = comm_history_view(h.snapshot())
    assert v.run is None and v.charts == () and v.probe_off is PROBE_SETTING


def test_hardware_view_with_gpus(service: Any) -> None:
    v = hardware_history_view(service.hardware_history())
    assert [c.key for c in v.charts] == ["cpu", "memory", "gpu-util", "gpu-power", "gpu-pcie",
                                         "gpu-nvlink"]
    assert v.samples == 360 and v.gpu_absent is None and v.gpu_off is None
    charts = {c.key: c for c in v.charts}
    assert [t["name"] for t in charts["gpu-pcie"].traces] == [
        "GPU 0 tx", "GPU 0 rx", "GPU 1 tx", "GPU 1 rx"]
    assert charts["gpu-pcie"].traces[1]["dash"] == "dot"
    assert 30 <= charts["cpu"].traces[0]["y"][0] <= 90  # percent
    assert charts["memory"].note == "used of 251.5 GiB"
    # 20 GiB/s per direction over 18 links, between two samples.
    assert charts["gpu-nvlink"].traces[0]["y"][1] == pytest.approx(20.0)


def test_hardware_view_without_gpu_keeps_the_host_and_says_why(canned: Any) -> None:
    h = HardwareHistory([], gpu_enabled=True, gpu_absent=lambda: "Driver Not Loaded")
    canned["hardware_history"](h, gpus=0)
    v = hardware_history_view(h.snapshot())
    assert [c.key for c in v.charts] == ["cpu", "memory"]
    assert v.gpu_absent == "NVML: Driver Not Loaded" and v.gpu_off is None
    silent = HardwareHistory([], gpu_enabled=True)
    assert hardware_history_view(silent.snapshot()).gpu_absent == "NVML reports none"
    off = hardware_history_view(HardwareHistory([], gpu_enabled=False).snapshot())
    assert off.gpu_off is GPU_SETTING and off.gpu_absent is None


def test_a_gpu_without_nvlink_counters_gets_no_nvlink_chart() -> None:
    h = HardwareHistory([], gpu_enabled=True)
    for i in range(3):
        h.record({"cpu": 0.5, "memory_used": 1.0, "memory_total": 2.0, "gpu_devices": 1,
                  "gpus": {"0": {"name": "T4", "utilization": 0.5, "power": 60.0}}},
                 at=float(i))
    keys = [c.key for c in hardware_history_view(h.snapshot()).charts]
    assert keys == ["cpu", "memory", "gpu-util", "gpu-power"]


def test_the_history_api(service: Any) -> None:
    with TestClient(create_app(service)) as c:
        comm = c.get("/api/comm/history").json()
        assert comm["run"] == 3 and comm["runs"] == [3]
        assert {e["op"] for e in comm["latency"]} == {"all_reduce", "all_gather"}
        assert len(comm["latency"][0]["p99"]) == 360 and len(comm["probe"]) == 8
        assert c.get("/api/comm/history", params={"run": 99}).json()["latency"] == []
        assert c.get("/api/comm/history", params={"run": "x"}).status_code == 422
        hw = c.get("/api/hardware/history").json()
        assert len(hw["time"]) == 360 and hw["gpu_devices"] == 2
        assert [g["gpu"] for g in hw["gpus"]] == ["0", "1"]
        assert hw["gpus"][0]["nvlink_tx"][0] is None  # no rate before the second sample
        paths = c.get("/api/openapi.json").json()["paths"]
    for path, schema in (("/api/comm/history", "CommHistoryOut"),
                         ("/api/hardware/history", "HardwareHistoryOut")):
        ok = paths[path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].endswith(schema), (path, ok)


def test_the_pages_name_the_probe_setting_when_no_probe_ran(fake_service: Any,
                                                            canned: Any) -> None:
    svc = fake_service(metric_samples=canned["comm"]())
    canned["comm_history"](svc.comm, probe=False)
    with TestClient(create_app(svc)) as c:
        text = " ".join(c.get("/comm?fragment=1").text.split())
    assert 'id="probe-off"' in text and "<code>telemetry.probe_every</code>" in text
    assert "<code>[telemetry] probe_every = 100</code>" in text
    assert "TRAIND_TELEMETRY__PROBE_EVERY=100" in text
    assert 'id="chart-latency-all_reduce"' in text


def fill_mesh(h: CommHistory, run: int = 9) -> None:
    """A tp2 x pp2 run: a tp comm event and a pipeline event from each of its four ranks."""
    from traind.contracts.comm import LATENCY_BOUNDS
    from traind.contracts.events import CommEvent, LifecycleEvent, PipelineEvent

    for rank in range(4):
        stage = rank // 2
        h(run, LifecycleEvent(rank=rank, phase="started", step=0,
                              detail={"mesh": {"dp": 1, "tp": 2, "pp": 2}}))
        h(run, CommEvent(rank=rank, step=10, method="none", steps=10, buckets=0, raw_bytes=0,
                         sent_bytes=0, rel_error=0.0, hook_seconds=0.0, allreduce_seconds=0.05,
                         world_size=2, mesh_dim="tp", time=100.0, collectives=[{
                             "op": "all_gather", "size": "64KiB", "calls": 110,
                             "bytes": 110 * 4096, "seconds": 0.04,
                             "counts": [0, 0, 110] + [0] * (len(LATENCY_BOUNDS) - 2)}]))
        fwd, bwd = ("send", "recv") if stage == 0 else ("recv", "send")
        h(run, PipelineEvent(rank=rank, step=10, stage=stage, stages=2, microbatches=4,
                             schedule="1f1b", busy_seconds=0.08, idle_seconds=0.02,
                             bubble=0.2, bubble_theory=0.2, p2p=[
                                 {"direction": "forward", "op": fwd, "calls": 4,
                                  "bytes": 4 * 2048},
                                 {"direction": "backward", "op": bwd, "calls": 4,
                                  "bytes": 4 * 2048}]))


def test_the_comm_page_draws_the_mesh_section(fake_service: Any, canned: Any) -> None:
    # a tp x pp job has no DDP hook and, without a probe, no gradient or probe series: the
    # page shows the newest run with history, the mesh run's, and no "single rank" notice
    svc = fake_service(metric_samples=canned["host"]())
    fill_mesh(svc.comm)
    v = comm_history_view(svc.comm.snapshot(9))
    assert v.mesh is not None and v.mesh.shape == "dp 1 x tp 2 x pp 2"
    assert [c.key for c in v.charts] == ["latency-all_gather-tp"]  # an id without spaces
    assert v.mesh.dims == (("tp", "44.0 KiB", "5 ms", "11"), ("pp", "8.0 KiB", "\u2013", "4"))
    with TestClient(create_app(svc)) as c:
        # the newest run with communication (the mesh run here) is the one shown over time
        text = " ".join(c.get("/comm?fragment=1").text.split())
        api = c.get("/api/comm/history", params={"run": 9}).json()
    assert 'id="mesh"' in text and "dp 1 x tp 2 x pp 2" in text and 'id="no-comm"' not in text
    for table in ("mesh-dims", "mesh-stages", "mesh-ranks"):
        assert f'id="{table}"' in text
    # rank 3: dp 0, tp 1, pp 1; stage 1's ranks; the bubble beside the theory
    assert ('<td class="num">3</td><td class="num">0</td> <td class="num">1</td>'
            '<td class="num">1</td>') in text
    assert "<td>2, 3</td>" in text and "<td class=\"num\">20%</td>" in text
    assert api["mesh"]["shape"] == {"dp": 1, "tp": 2, "pp": 2}
    assert [d["mesh_dim"] for d in api["mesh"]["dims"]] == ["tp", "pp"]
    assert api["mesh"]["stages"][1]["sent_backward_bytes"] == 8192


def test_a_run_without_tp_or_pp_has_no_mesh_section(service: Any) -> None:
    assert comm_history_view(service.comm_history()).mesh is None
    with TestClient(create_app(service)) as c:
        assert 'id="mesh"' not in c.get("/comm?fragment=1").text
