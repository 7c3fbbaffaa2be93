"""A run's stored communication: sealed per flush by the recorder (bounded), read back per op
over steps (calls, bandwidth, latency percentiles from the buckets, compression)."""

from __future__ import annotations

from typing import Any

import pytest

from traind.contracts.comm import LATENCY_BOUNDS, latency_bin
from traind.contracts.events import CommEvent
from traind.daemon.ingest import series as ingest
from traind.daemon.ingest.series import COMM, SeriesRecorder
from traind.daemon.runs.comm_series import comm_lines, merge_comm
from traind.daemon.runs.series_fold import comm_page
from traind.metrics.arithmetic import bucket_quantile, window_bandwidth


def counts(*seconds: float) -> list[int]:
    out = [0] * (len(LATENCY_BOUNDS) + 1)
    for s in seconds:
        out[latency_bin(s)] += 1
    return out


def report(step: int, rank: int, *, seconds: float = 1e-3, calls: int = 4,
           raw: int = 4000, sent: int = 1000, steps: int = 2, world: int = 2) -> CommEvent:
    return CommEvent(
        rank=rank, step=step, method="powersgd", steps=steps, buckets=calls, raw_bytes=raw,
        sent_bytes=sent, rel_error=0.0, hook_seconds=0.0, allreduce_seconds=seconds * calls,
        world_size=world, collectives=[{
            "op": "all_reduce", "size": "1MiB", "calls": calls, "bytes": 250 * calls,
            "seconds": seconds * calls, "counts": counts(*[seconds] * calls)}])


class Rows:
    def __init__(self) -> None:
        self.got: list[tuple[int, dict[str, Any]]] = []

    def add(self, run_id: int, event: dict[str, Any]) -> None:
        self.got.append((run_id, event))


def sealed(rec: SeriesRecorder) -> list[dict[str, Any]]:
    out = Rows()
    rec.seal(out)  # type: ignore[arg-type]
    return [e for _, e in out.got]


def test_every_ranks_report_is_one_comm_row_a_flush() -> None:
    rec = SeriesRecorder(lambda run: 1.0, lambda run: 2)
    for s in (2, 4):
        for r in (0, 1):
            rec.every_rank(7, report(s, r))
    (row,) = sealed(rec)
    assert row["kind"] == COMM and row["step"] == 2
    assert row["data"]["reports"]["rank"] == [0, 1, 0, 1]
    assert row["data"]["collectives"]["op"] == ["all_reduce"] * 4
    assert row["data"]["collectives"]["world_size"] == [2] * 4
    assert sealed(rec) == []  # sealed once


def test_a_burst_past_the_cap_folds_into_the_newest_row(monkeypatch: Any) -> None:
    monkeypatch.setattr(ingest, "COMM_ROWS", 2)
    rec = SeriesRecorder(lambda run: 1.0, lambda run: 1)
    for s in (1, 2, 3, 4):
        rec.every_rank(7, report(s, 0, calls=2))
    (row,) = sealed(rec)
    cols = row["data"]["collectives"]
    assert cols["step"] == [1, 4] and cols["calls"] == [2, 6]  # nothing lost but resolution
    assert sum(cols["counts"][1]) == 6 and len(row["data"]["reports"]["step"]) == 4


def chunks_of(*events: CommEvent) -> list[dict[str, Any]]:
    rec = SeriesRecorder(lambda run: 1.0, lambda run: 2)
    for e in events:
        rec.every_rank(1, e)
    return [e["data"] for e in sealed(rec)]


def whole(chunks: list[dict[str, Any]], points: int) -> dict[str, Any]:
    """A whole page's comm, from the chunks as stored (oldest first), as the page gets it."""
    import json

    from traind.web.encode import json_bytes

    lo = min((s for c in chunks for s in c["reports"]["step"]), default=0)
    return json.loads(json_bytes(comm_page(chunks[::-1], lo, points)))


def test_per_op_lines_sum_ranks_and_read_percentiles_from_the_buckets() -> None:
    chunks = chunks_of(report(2, 0, seconds=1e-3), report(2, 1, seconds=2e-2),
                       report(4, 0, seconds=1e-3), report(4, 1, seconds=1e-3))
    got = whole(chunks, points=100)
    (line,) = got["ops"]
    assert line["op"] == "all_reduce" and line["step"] == [2, 4]
    assert line["calls"] == [2.0, 2.0]  # 4 calls per rank over its 2 steps
    assert line["mean"] == pytest.approx([(4e-3 + 8e-2) / 8, 1e-3])
    both = [a + b for a, b in zip(counts(*[1e-3] * 4), counts(*[2e-2] * 4), strict=True)]
    assert line["p99"][0] == pytest.approx(bucket_quantile(0.99, LATENCY_BOUNDS, both))
    assert line["p50"][1] == pytest.approx(bucket_quantile(0.5, LATENCY_BOUNDS,
                                                           counts(*[1e-3] * 8)))
    # The one definition the gauges use, of the summed bytes over the summed seconds.
    assert line["bus_bandwidth"][1] == pytest.approx(
        window_bandwidth("all_reduce", 2000, 8e-3, 2)[1])
    assert got["bytes"] == {"step": [2, 4], "raw": [2000.0, 2000.0], "sent": [500.0, 500.0],
                            "ratio": [4.0, 4.0]}


@pytest.mark.parametrize(("points", "after", "steps", "more"), [
    (2, None, [4, 8], False),  # two buckets of two reports, each at its last step
    (10, None, [2, 4, 6, 8], False),
    (10, 4, [4, 6, 8], False),  # a poll's tail: from the step on, one report a point
    (2, 4, [4, 6], True),  # capped: the page fetches the whole series again
    (10, 9, [], False),
])
def test_downsampled_by_summing_reports_or_a_tail(points: int, after: int | None,
                                                  steps: list[int], more: bool) -> None:
    chunks = chunks_of(*(report(s, r) for s in (2, 4, 6, 8) for r in (0, 1)))
    got = (whole(chunks, points) if after is None
           else comm_lines(*merge_comm(chunks), points=points, after=after))
    assert [x["step"] for x in got["ops"]] == ([steps] if steps else [])
    assert got["bytes"]["step"] == steps and got["more"] is more
    if after is None and points == 2:
        assert got["ops"][0]["calls"] == [2.0, 2.0]  # sums over the bucket, per rank step


def test_a_redone_report_keeps_its_newest_figures_and_no_comm_is_empty() -> None:
    old = chunks_of(report(2, 0, seconds=1e-3))
    new = chunks_of(report(2, 0, seconds=4e-3))
    (line,) = whole([*old, *new], points=10)["ops"]
    assert line["mean"] == pytest.approx([4e-3])
    assert whole([], points=10) == {
        "reports": 0, "more": False, "ops": [],
        "bytes": {"step": [], "raw": [], "sent": [], "ratio": []}}


def test_each_mesh_dim_is_its_own_line_and_only_dp_reports_carry_bytes() -> None:
    import dataclasses

    dp = report(2, 0, seconds=1e-3, steps=2)
    tp = dataclasses.replace(report(2, 0, seconds=2e-3, calls=6, raw=0, sent=0, steps=2),
                             mesh_dim="tp", method="none")
    got = whole(chunks_of(dp, tp), points=10)
    lines = {line["op"]: line for line in got["ops"]}
    assert list(lines) == ["all_reduce", "all_reduce (tp)"]  # dp's first
    assert lines["all_reduce (tp)"]["mesh_dim"] == "tp"
    assert lines["all_reduce (tp)"]["calls"] == [6 / 2] and lines["all_reduce"]["calls"] == [2]
    assert lines["all_reduce (tp)"]["mean"] == pytest.approx([2e-3])
    # the raw and sent bytes per rank and step are the hook's alone, not diluted by tp's
    assert got["bytes"]["raw"] == [2000] and got["bytes"]["sent"] == [500]
    only_tp = whole(chunks_of(tp), points=10)
    assert only_tp["bytes"]["raw"] == [None] and only_tp["bytes"]["ratio"] == [None]


def test_a_chunk_stored_before_mesh_dim_reads_as_dp() -> None:
    (chunk,) = chunks_of(report(2, 0), report(2, 1))
    for table in chunk.values():
        del table["mesh_dim"]
    (line,) = whole([chunk], points=10)["ops"]
    assert (line["op"], line["mesh_dim"], line["calls"]) == ("all_reduce", "dp", [2])
