"""A run's stored series: gathered in columns, sealed once a flush, read back merged and
downsampled; and end to end on a real node, kept across a daemon restart."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import pytest

from traind.contracts.comm import LATENCY_BOUNDS
from traind.contracts.events import EvalEvent, LayerEvent, StepEvent
from traind.daemon.config import load_settings
from traind.daemon.db import crud
from traind.daemon.ingest.event_buffer import EventBuffer
from traind.daemon.ingest.series import (
    COMM,
    LAYERS,
    RANK_COLUMNS,
    RANK_STEPS,
    STEP_COLUMNS,
    STEPS,
    SeriesRecorder,
)
from traind.daemon.node import Node
from traind.daemon.runs import series
from traind.daemon.runs.jobs import LOG_NAME, log_tail, read_tail

if TYPE_CHECKING:
    from pathlib import Path


def step(n: int, loss: float = 2.0, *, rank: int = 0, seconds: float = 0.1,
         forward: float = 0.03) -> StepEvent:
    return StepEvent(rank=rank, step=n, loss=loss, lr=1e-3, grad_norm=0.5, tokens=64,
                     step_seconds=seconds, data_seconds=0.01, forward_seconds=forward,
                     backward_seconds=0.05, optimizer_seconds=0.01, time=100.0 + n)


def layers(n: int, names: tuple[str, ...] = ("a", "b")) -> LayerEvent:
    return LayerEvent(rank=0, step=n, layers=list(names), grad_norm=[float(n)] * len(names),
                      weight_norm=[1.0] * len(names), update_ratio=[math.nan] * len(names))


def sealed(rec: SeriesRecorder, tmp_path: Path) -> list[tuple[int, dict]]:
    buf = EventBuffer(tmp_path / "spill.jsonl")
    rec.seal(buf)
    got: list[tuple[int, dict]] = []
    buf.flush(lambda run, events: got.extend((run, e) for e in events))
    return got


def test_a_flush_seals_one_row_per_run_and_kind_in_columns(tmp_path: Path) -> None:
    rec = SeriesRecorder(lambda run: 10.0 * run)
    for n in (1, 2, 3):
        rec(7, step(n, loss=math.nan if n == 2 else 2.0))
    rec(8, step(1))
    rec(7, layers(2))
    rec(7, layers(4, ("a", "b", "c")))  # a new layout: a chunk of its own
    rec(7, EvalEvent(rank=0, step=3, val_loss=1.0, batches=1))  # not a series: ignored
    rows = sealed(rec, tmp_path)
    by = {(run, e["kind"], e["step"]): e["data"] for run, e in rows}
    assert set(by) == {(7, STEPS, 1), (8, STEPS, 1), (7, LAYERS, 2), (7, LAYERS, 4)}
    cols = by[(7, STEPS, 1)]
    assert list(cols) == list(STEP_COLUMNS)
    assert cols["step"] == [1, 2, 3] and cols["loss"] == [2.0, None, 2.0]  # JSON: no NaN
    assert cols["tokens_per_second"] == [70.0] * 3 and cols["time"] == [101.0, 102.0, 103.0]
    assert by[(7, LAYERS, 2)] == {"layers": ["a", "b"], "step": [2], "grad_norm": [[2.0, 2.0]],
                                  "update_ratio": [[None, None]]}
    assert by[(7, LAYERS, 4)]["layers"] == ["a", "b", "c"]
    assert sealed(rec, tmp_path) == []  # sealed once: nothing is written twice


def test_a_multi_rank_run_seals_one_row_of_every_ranks_figures(tmp_path: Path) -> None:
    ranks = {7: 2, 8: 1}
    rec = SeriesRecorder(lambda run: 1.0, lambda run: ranks[run])
    for n in (1, 2):
        for r in (0, 1):
            rec.every_rank(7, step(n, loss=2.0 + r, rank=r, seconds=0.1 * (r + 1)))
        rec.every_rank(8, step(n))  # one rank: its lead's row says it all
    rec.every_rank(7, LayerEvent(rank=1, step=2, layers=["a"], grad_norm=[1.0],
                                 weight_norm=[1.0], update_ratio=[1.0]))  # not per rank
    rows = sealed(rec, tmp_path)
    assert [(run, e["kind"], e["step"]) for run, e in rows] == [(7, RANK_STEPS, 1)]
    cols = rows[0][1]["data"]
    assert list(cols) == list(RANK_COLUMNS)
    assert cols["rank"] == [0, 1, 0, 1] and cols["step"] == [1, 1, 2, 2]
    assert cols["loss"] == [2.0, 3.0, 2.0, 3.0]  # each rank's own batch
    assert cols["tokens_per_second"] == pytest.approx([640.0, 320.0] * 2)  # 64 / its step
    assert sealed(rec, tmp_path) == []


def test_per_rank_lines_and_the_straggler() -> None:
    def chunk(steps: range, rank: int, seconds: float, forward: float) -> dict[str, list]:
        n = len(steps)
        return {"step": list(steps), "rank": [rank] * n, "loss": [2.0] * n,
                "tokens_per_second": [64 / seconds] * n, "step_seconds": [seconds] * n,
                "data_seconds": [0.01] * n, "forward_seconds": [forward] * n,
                "backward_seconds": [0.05] * n, "optimizer_seconds": [0.01] * n}

    chunks = [chunk(range(1, 101), 1, 0.2, 0.12), chunk(range(1, 101), 0, 0.1, 0.03),
              chunk(range(51, 61), 1, 9.0, 0.12)]  # rank 1's steps 51-60 redone, once slow
    per_rank = series.merge_ranks(chunks)
    assert list(per_rank) == [0, 1] and per_rank[1]["step"] == list(range(1, 101))
    assert per_rank[1]["step_seconds"][50] == 9.0  # the newest figures win
    lines = series.rank_lines(per_rank, points=10)
    assert [(x["rank"], x["points"], len(x["step"])) for x in lines] == [(0, 100, 10),
                                                                          (1, 100, 10)]
    assert lines[0]["step"][-1] == 100 and lines[1]["step_seconds"][5] == pytest.approx(9.0)
    assert set(lines[0]) == {"rank", "points", "step", *series.RANK_FIGURES}
    table = {row["rank"]: row for row in series.rank_table(per_rank)}
    # A median: ten slow steps do not make rank 1's step 9 s; twice rank 0's is a straggler.
    assert table[1]["step_seconds"] == pytest.approx(0.2)
    assert table[1]["slow"] == ["step_seconds", "forward_seconds"] and table[0]["slow"] == []


@pytest.mark.parametrize(("ranks", "points", "each"), [(2, 2000, 2000), (8, 2000, 2000),
                                                        (64, 2000, 250), (4000, 2000, 10)])
def test_many_ranks_share_the_point_budget(ranks: int, points: int, each: int) -> None:
    per_rank = {r: {"step": list(range(3000)), **{f: [1.0] * 3000 for f in series.RANK_FIGURES}}
                for r in range(ranks)}
    assert len(series.rank_lines(per_rank, points)[0]["step"]) == each


@pytest.mark.parametrize(("a", "b", "slow"), [
    (0.100, 0.119, False),  # under 1.2x
    (0.0001, 0.0009, False),  # 9x, but under a millisecond apart
    (0.100, 0.121, True),
])
def test_a_straggler_is_a_clear_margin(a: float, b: float, slow: bool) -> None:
    per_rank = {r: {"step": [1], **{f: [0.0] for f in series.RANK_FIGURES}, "data_seconds": [v]}
                for r, v in ((0, a), (1, b))}
    table = series.rank_table(per_rank)
    assert table[1]["slow"] == (["data_seconds"] if slow else []) and table[0]["slow"] == []


def test_merge_keeps_each_steps_newest_figures_in_step_order() -> None:
    def chunk(steps: list[int], loss: float) -> dict:
        return {c: list(steps) if c == "step" else [loss] * len(steps) for c in STEP_COLUMNS}

    # Steps 3-4 ran, the run restarted from its step-2 checkpoint and redid them.
    merged = series.merge_steps([chunk([1, 2, 3, 4], 9.0), chunk([3, 4, 5], 1.0)])
    assert merged["step"] == [1, 2, 3, 4, 5]
    assert merged["loss"] == [9.0, 9.0, 1.0, 1.0, 1.0]
    # An older chunk without a column (a daemon before it) reads as None there.
    old = {"step": [6], "loss": [2.0]}
    assert series.merge_steps([old])["lr"] == [None]


@pytest.mark.parametrize(("n", "points", "spans"), [
    (0, 5, []),
    (3, 5, [(0, 1), (1, 2), (2, 3)]),
    (6, 3, [(0, 2), (2, 4), (4, 6)]),
    (7, 3, [(0, 2), (2, 4), (4, 7)]),
])
def test_buckets_split_evenly(n: int, points: int, spans: list[tuple[int, int]]) -> None:
    assert series.buckets(n, points) == spans


def test_the_envelope_keeps_a_spike_that_the_mean_hides() -> None:
    values = [1.0, 1.0, 1.0, 50.0, None, math.nan, 2.0, 2.0]
    env = series.envelope(values, series.buckets(len(values), 2))
    assert env["hi"][0] == 50.0 and env["lo"][0] == 1.0
    assert env["y"][0] == pytest.approx(53.0 / 4)
    assert env["y"][1] == 2.0  # None and NaN are left out, not counted as zero
    assert series.envelope([None], [(0, 1)]) == {"y": [None], "lo": [None], "hi": [None]}


def test_downsample_a_long_run_to_a_page() -> None:
    n = 100_000
    cols = {c: list(range(1, n + 1)) if c in ("step", "time") else [float(i % 100) for i in
                                                                   range(n)]
            for c in STEP_COLUMNS}
    out = series.downsample(cols, points=1000)
    assert out["points"] == n and len(out["step"]) == 1000 and out["step"][-1] == n
    assert out["step"][0] == 100  # each point is drawn at its bucket's last step
    assert out["loss"]["lo"][0] == 0.0 and out["loss"]["hi"][0] == 99.0
    short = series.downsample({c: [1, 2] for c in STEP_COLUMNS}, points=1000)
    assert short["step"] == [1, 2] and short["loss"] == {"y": [1, 2], "lo": [1, 2], "hi": [1, 2]}


def test_the_layer_map_is_layers_by_steps_of_the_newest_layout() -> None:
    def chunk(names: list[str], steps: list[int]) -> dict:
        return {"layers": names, "step": steps,
                "grad_norm": [[float(s)] * len(names) for s in steps],
                "update_ratio": [[None] * len(names) for _ in steps]}

    m = series.layer_map([chunk(["x"], [1]), chunk(["a", "b"], [10, 20, 30, 40])], columns=2)
    assert m["layers"] == ["a", "b"] and m["step"] == [20, 40]
    assert m["grad_norm"] == [[15.0, 35.0], [15.0, 35.0]]  # one row per layer
    assert m["update_ratio"] == [[None, None], [None, None]]
    assert series.layer_map([])["layers"] == []


def test_the_export_has_every_step_and_the_validation_loss_where_it_ran() -> None:
    cols = {c: [2, 4] if c == "step" else [0.5, 0.25] for c in STEP_COLUMNS}
    rows = list(series.csv_rows(cols, [(1, 3.0), (4, 2.0), (9, 1.0)]))
    blank = [None] * (len(STEP_COLUMNS) - 1)
    assert rows == [[*STEP_COLUMNS, "val_loss"], [1, *blank, 3.0], [2, *[0.5] * 7, None],
                    [4, *[0.25] * 7, 2.0], [9, *blank, 1.0]]


def test_a_log_tail_reads_only_the_end_and_no_cut_line(tmp_path: Path) -> None:
    log = tmp_path / LOG_NAME
    log.write_bytes(b"".join(b"line %06d\n" % i for i in range(20_000)))  # 240 kB
    tail = log_tail(str(tmp_path), lines=3)
    assert tail == "line 019997\nline 019998\nline 019999\n"
    short = read_tail(log, 10_000).splitlines()
    assert short[0].startswith("line ") and len(short[0]) == 11  # whole lines only
    assert log_tail("", 5) == "" and log_tail(str(tmp_path / "none"), 5) == ""


TINY = ["job.steps=40", "job.eval_every=10", "job.eval_batches=1", "job.checkpoint_every=20",
        "job.threads=1", "job.batch_size=4", "model.seq_len=32", "model.d_model=32",
        "model.n_layers=2", "model.n_heads=2", "data.max_bytes=300000",
        "daemon.default_job=false", "telemetry.layer_every=5"]


def _node(tmp_path: Path) -> Node:
    node = Node(load_settings(env={}, overrides=[*TINY, f"daemon.var_dir={tmp_path}"]))
    node.migrate()
    return node


@pytest.mark.slow
def test_a_finished_runs_series_outlives_the_daemon(tmp_path: Path) -> None:
    node = _node(tmp_path)

    async def main() -> int:
        rid = await node.submit(node.settings)
        await asyncio.wait(node.supervisor.tasks, timeout=120)
        node.flusher.flush()
        return rid

    rid = asyncio.run(main())
    assert crud.get_run(node.engine, run_id=rid).state == "completed"  # type: ignore[union-attr]
    node.engine.dispose()
    again = _node(tmp_path)  # a restarted daemon: nothing of the run is in its memory
    assert again.hub.snapshot(rid)["steps"] == []
    got = again.service.run_series(rid, points=25)
    assert got is not None and got["points"] == 40
    assert len(got["step"]) == 25 and got["step"][-1] == 40
    assert all(v is not None and v > 0 for v in got["loss"]["y"])
    assert got["tokens_per_second"]["y"][-1] > 0
    assert got["evals"]["step"] == [10, 20, 30, 40]
    assert got["layers"]["layers"] and got["layers"]["step"][-1] == 40
    assert len(got["layers"]["grad_norm"]) == len(got["layers"]["layers"])
    rows = again.service.run_export(rid)
    assert rows is not None and len(rows) == 41 and [r[0] for r in rows[1:]] == list(
        range(1, 41))
    assert rows[10][-1] is not None and rows[11][-1] is None  # val loss at step 10 only
    detail = again.service.run_detail(rid)
    assert detail is not None and detail.config["job"]["steps"] == 40
    assert next(e["kind"] for e in detail.events) == "started"
    assert {"checkpoint", "finished"} <= {e["kind"] for e in detail.events}
    assert detail.log_tail == "" and not detail.running_here  # a clean run logs nothing
    assert again.service.run_series(rid + 100, points=10) is None
    # One rank: no per-rank rows (they would repeat the lead's).
    assert (again.service.run_series(rid, points=25, ranks=True) or {})["ranks"] == {
        "lines": [], "table": []}
    assert crud.run_chunks(again.engine, run_id=rid, kind=RANK_STEPS) == []
    assert (again.service.run_series(rid, points=25, comm=True) or {})["comm"]["ops"] == []


@pytest.mark.slow
def test_a_two_rank_gloo_run_keeps_a_series_per_rank(tmp_path: Path) -> None:
    node = Node(load_settings(env={}, overrides=[
        *TINY, "job.steps=12", "job.checkpoint_every=12", "job.nproc_per_node=2",
        f"daemon.var_dir={tmp_path}"]))
    node.migrate()

    async def main() -> int:
        rid = await node.submit(node.settings)
        await asyncio.wait(node.supervisor.tasks, timeout=180)
        node.flusher.flush()
        return rid

    rid = asyncio.run(main())
    assert crud.get_run(node.engine, run_id=rid).state == "completed"  # type: ignore[union-attr]
    got = node.service.run_series(rid, points=100, ranks=True)
    assert got is not None and got["points"] == 12
    lines = got["ranks"]["lines"]
    assert [x["rank"] for x in lines] == [0, 1] and all(x["points"] == 12 for x in lines)
    assert all(v is not None and v > 0 for x in lines for v in x["step_seconds"])
    assert all(v is not None and v > 0 for x in lines for v in x["tokens_per_second"])
    # Each rank's own batch: the losses differ (reported before any all-reduce).
    assert lines[0]["loss"] != lines[1]["loss"]
    assert {row["rank"] for row in got["ranks"]["table"]} == {0, 1}
    # The lead's series is still one line: rank 0's.
    assert got["step"] == lines[0]["step"]
    assert "ranks" not in (node.service.run_series(rid, points=100) or {})  # not unasked
    # Every rank's communication, stored: per op over steps, and a poll's tail of it.
    stored = crud.run_chunks(node.engine, run_id=rid, kind=COMM)
    assert stored and {0, 1} <= {r for c in stored for r in c["reports"]["rank"]}
    assert {r for c in stored for r in c["collectives"]["rank"]} == {0, 1}
    assert all(len(n) == len(LATENCY_BOUNDS) + 1 for c in stored
               for n in c["collectives"]["counts"])
    comm = (node.service.run_series(rid, points=100, comm=True) or {})["comm"]
    ar = next(x for x in comm["ops"] if x["op"] == "all_reduce")
    assert ar["step"] and all(v is not None and v > 0 for v in ar["p50"] + ar["mean"])
    assert all(v is not None and v > 0 for v in ar["bus_bandwidth"] + ar["calls"])
    assert all(r > 0 and s > 0 for r, s in zip(comm["bytes"]["raw"], comm["bytes"]["sent"],
                                                strict=True))
    tail = node.service.run_series(rid, points=100, ranks=True, comm=True, after=8) or {}
    assert tail["step"] == [9, 10, 11, 12] and tail["after"] == 8
    assert all(s >= 8 for s in tail["comm"]["bytes"]["step"])
    assert [x["step"][0] for x in tail["ranks"]["lines"]] == [8, 8]
    node.engine.dispose()


def _cols(n: int) -> dict[str, list]:
    return {c: (list(range(1, n + 1)) if c == "step" else [float(s) for s in range(1, n + 1)])
            for c in STEP_COLUMNS}


@pytest.mark.parametrize(("n", "after", "points", "steps", "more"), [
    (10, 7, 100, [8, 9, 10], False),  # the steps after it, one a point
    (10, 0, 3, [1, 2, 3], True),  # capped at points: the page refetches the whole
    (10, 10, 100, [], False),  # nothing new
    (10, -1, 100, list(range(1, 11)), False),
    (0, 5, 100, [], False),
])
def test_a_polls_tail_is_the_steps_after_at_full_resolution(
        n: int, after: int, points: int, steps: list[int], more: bool) -> None:
    got = series.steps_after(_cols(n), after, points)
    assert got["step"] == steps and got["points"] == len(steps) and got["more"] is more
    assert got["loss"] == {"y": [float(s) for s in steps]} and got["after"] == after


def test_a_tails_reports_start_at_the_step_and_keep_their_shape() -> None:
    from traind.daemon.runs.series_page import series_page

    chunks = [{"layers": ["a", "b"], "step": [5, 10], "grad_norm": [[1, 2], [3, 4]],
               "update_ratio": [[0.1, 0.2], [0.3, 0.4]]}]
    ranks = [{"step": [9, 10, 11], "rank": [r] * 3, **{c: [float(r)] * 3 for c in
              RANK_COLUMNS if c not in ("step", "rank")}} for r in (0, 1)]
    page = series_page(1, _cols(12), evals=[(5, 3.0), (10, 2.5)], points=100,
                       precision=[{"step": 4, "group": "g"}, {"step": 10, "group": "g"}],
                       layer_chunks=chunks, rank_chunks=ranks, comm_chunks=[], after=10)
    assert page["step"] == [11, 12] and page["after"] == 10
    assert page["evals"] == {"step": [10], "val_loss": [2.5]}  # an eval at 10 may come late
    assert [p["step"] for p in page["precision"]] == [10]
    assert page["layers"] == {"layers": ["a", "b"], "step": [10], "grad_norm": [[3], [4]],
                              "update_ratio": [[0.3], [0.4]]}
    assert [x["step"] for x in page["ranks"]["lines"]] == [[10, 11], [10, 11]]
    assert "table" not in page["ranks"] and page["comm"]["ops"] == []
    whole = series_page(1, _cols(12), evals=[(5, 3.0)], points=100, precision=[],
                        layer_chunks=chunks)
    assert whole["points"] == 12 and "after" not in whole and "ranks" not in whole
    assert "comm" not in whole and whole["loss"]["lo"] == whole["loss"]["y"]
