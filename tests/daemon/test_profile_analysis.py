"""The profile report's arithmetic (daemon/profiles/analysis.py) on traces built by hand, so
every figure is known: host (gloo) and device (CUDA, NCCL kernels) timelines, self times,
memory, and the straggler view on the shared clock."""

from __future__ import annotations

import gzip
import json
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traind.daemon.profiles.analysis import (
    TraceError,
    breakdown,
    intersection,
    length,
    load_trace,
    memory,
    report,
    self_times,
    timelines,
    union,
)

if TYPE_CHECKING:
    from pathlib import Path

MAIN, GLOO = 100, 200  # thread ids


def x(name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = MAIN
      ) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def mem(ts: float, total: int, device: int = 0) -> dict[str, Any]:
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": MAIN,
            "ts": ts, "args": {"Total Allocated": total, "Device Type": device}}


def host_trace(*, step_at: float = 0.0, base_ns: int = 1_000_000_000_000) -> dict[str, Any]:
    """Two steps of 100 µs: compute 0-60 (a linear op holding a 40 µs mm), a gloo all-reduce
    50-80 on its own thread; step 2 the same 100 µs later, and a memory rise and fall."""
    events = []
    for k, step in enumerate((7, 8)):
        t = step_at + 100 * k
        events += [
            x(f"traind.step#{step}", t, 100, cat="user_annotation"),
            x("aten::linear", t, 60),
            x("aten::mm", t + 10, 40),
            x("c10d::allreduce_", t + 50, 2),  # the enqueue, on the training thread
            x("gloo:all_reduce", t + 50, 30, cat="user_annotation", tid=GLOO),
        ]
    events += [mem(0, 1 << 20), mem(30, 3 << 20), mem(150, 1 << 20)]
    return {"traceEvents": events, "baseTimeNanoseconds": base_ns}


def test_a_host_steps_split_is_exact_and_adds_up() -> None:
    t = timelines(host_trace())
    assert t.timeline == "host" and t.steps == {7: (0, 100), 8: (100, 200)}
    b = breakdown(t, t.steps[7])
    # compute: the training thread's ops, 0-60 (the c10d enqueue is communication)
    assert b["compute_ms"] == pytest.approx(0.060)
    assert b["comm_ms"] == pytest.approx(0.030)  # 50-80
    assert b["exposed_comm_ms"] == pytest.approx(0.020)  # 60-80: no compute beside it
    assert b["idle_ms"] == pytest.approx(0.020)  # 80-100
    assert b["overlap"] == pytest.approx(10 / 30)
    assert b["compute_ms"] + b["exposed_comm_ms"] + b["memcpy_ms"] + b["idle_ms"] \
        == pytest.approx(b["window_ms"])
    assert t.first_comm == {7: 50, 8: 150}


def test_a_device_trace_is_split_on_its_kernels_with_nccl_as_communication() -> None:
    events = [x("traind.step#3", 0, 1000, cat="user_annotation"),
              x("aten::mm", 0, 900),  # host time: not the device's work
              x("sm90_xmma_gemm_bf16", 100, 300, cat="kernel", tid=7),
              x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 300, 400, cat="kernel", tid=8),
              x("Memcpy DtoH (Device -> Pinned)", 750, 50, cat="gpu_memcpy", tid=7)]
    t = timelines({"traceEvents": events})
    assert t.timeline == "device"
    b = breakdown(t, t.steps[3])
    assert b["compute_ms"] == pytest.approx(0.300)  # 100-400
    assert b["comm_ms"] == pytest.approx(0.400)  # 300-700
    assert b["exposed_comm_ms"] == pytest.approx(0.300)  # 400-700
    assert b["memcpy_ms"] == pytest.approx(0.050)
    assert b["idle_ms"] == pytest.approx(1.0 - 0.3 - 0.3 - 0.05)
    assert b["overlap"] == pytest.approx(0.25)
    body = report({0: {"traceEvents": events}}, {})
    assert [op["name"] for op in body["ranks"][0]["top_ops"]] == [
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "sm90_xmma_gemm_bf16"]


def test_self_time_takes_the_children_out_of_their_parent() -> None:
    got = dict(self_times([x("aten::linear", 0, 60), x("aten::mm", 10, 40),
                           x("aten::t", 12, 5), x("aten::add", 70, 5)]))
    assert got == {"aten::linear": 20, "aten::mm": 35, "aten::t": 5, "aten::add": 5}


def test_the_straggler_view_lines_ranks_up_on_the_shared_clock() -> None:
    # rank 1's clock runs 2 ms ahead of rank 0's: its trace says it arrived 2.5 ms later,
    # the shared clock 0.5 ms
    zero = host_trace()
    one = host_trace(base_ns=1_000_000_000_000 + 2_500_000)
    body = report({0: zero, 1: one}, {0: 0.0, 1: 0.002})
    assert [s["step"] for s in body["straggler"]] == [7, 8]
    for s in body["straggler"]:
        assert s["last"] == 1 and s["skew_ms"] == pytest.approx(0.5)
    assert body["last_counts"] == {"1": 2} and body["median_skew_ms"] == pytest.approx(0.5)
    # without the offset, the skew would read 2.5 ms
    assert report({0: zero, 1: one}, {})["straggler"][0]["skew_ms"] == pytest.approx(2.5)


def test_memory_is_thinned_keeping_its_peak() -> None:
    events = [mem(i, (i % 97) << 20) for i in range(5000)]
    got = memory({"traceEvents": events}, t0=0.0, points=100)["cpu"]
    assert len(got["t_ms"]) <= 100 and got["peak_mib"] == 96 and max(got["mib"]) == 96


def test_a_rank_report_without_step_marks_or_a_broken_file_is_a_named_error(
        tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="rank 2's trace holds no traced step"):
        report({2: {"traceEvents": [x("aten::mm", 0, 1)]}}, {})
    bad = tmp_path / "rank0.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(TraceError, match=r"rank0\.json\.gz: not a readable trace"):
        load_trace(bad)
    plain = tmp_path / "rank1.json.gz"
    plain.write_bytes(gzip.compress(json.dumps({"events": []}).encode()))
    with pytest.raises(TraceError, match="not a Chrome trace"):
        load_trace(plain)


spans = st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 200)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(compute=spans, comm=spans, copies=spans)
def test_the_buckets_always_add_up_to_the_window(compute: list[tuple[int, int]],
                                                 comm: list[tuple[int, int]],
                                                 copies: list[tuple[int, int]]) -> None:
    events = [x("traind.step#1", 100, 800, cat="user_annotation"),
              *(x("gemm", s, d, cat="kernel") for s, d in compute),
              *(x("ncclKernel", s, d, cat="kernel") for s, d in comm),
              *(x("Memset", s, d, cat="gpu_memset") for s, d in copies)]
    t = timelines({"traceEvents": events})
    b = breakdown(t, (100, 900))
    parts = [b["compute_ms"], b["exposed_comm_ms"], b["memcpy_ms"], b["idle_ms"]]
    assert all(p is not None and p >= -1e-9 for p in parts)
    assert sum(p for p in parts if p is not None) == pytest.approx(0.8)
    merged_comm = union((s, s + d) for s, d in comm)
    assert length(intersection(merged_comm, merged_comm)) == pytest.approx(length(merged_comm))
