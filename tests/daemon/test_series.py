"""A run's stored series: gathered in columns, sealed once a flush, read back merged and
downsampled; and end to end on a real node, kept across a daemon restart."""

from __future__ import annotations

import asyncio
import json
import math
from typing import TYPE_CHECKING, Any

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
from traind.daemon.runs import series, series_fold
from traind.daemon.runs.jobs import LOG_NAME, log_tail, read_tail
from traind.web.encode import json_bytes

if TYPE_CHECKING:
    from pathlib import Path


def plain(value: Any) -> Any:
    """What the page gets: the folds' numpy arrays as JSON lists (NaN: None)."""
    return json.loads(json_bytes(value))


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

    redone = chunk(range(51, 101), 1, 0.2, 0.12)  # rank 1 resumed at 51, its 51-60 slow
    redone["step_seconds"][:10] = [9.0] * 10
    chunks = [chunk(range(1, 101), 1, 0.2, 0.12), chunk(range(1, 101), 0, 0.1, 0.03), redone]
    got = plain(series_fold.ranks_page(chunks[::-1], 1, points=10))  # newest first
    lines = got["lines"]
    assert [(x["rank"], x["points"], len(x["step"])) for x in lines] == [(0, 100, 10),
                                                                          (1, 100, 10)]
    # From 51 on rank 1's newest figures (51-60 slow), not those of the life it redid.
    assert lines[0]["step"][-1] == 100 and lines[1]["step_seconds"][5] == pytest.approx(9.0)
    assert lines[1]["step_seconds"][4] == pytest.approx(0.2)
    assert set(lines[0]) == {"rank", "points", "step", *series.RANK_FIGURES}
    table = {row["rank"]: row for row in got["table"]}
    # A median: ten slow steps do not make rank 1's step 9 s; twice rank 0's is a straggler.
    assert table[1]["step_seconds"] == pytest.approx(0.2)
    assert table[1]["slow"] == ["step_seconds", "forward_seconds"] and table[0]["slow"] == []


@pytest.mark.parametrize(("ranks", "steps", "points", "each"), [
    (2, 3000, 2000, 2000), (8, 3000, 2000, 2000), (64, 3000, 2000, 250), (4000, 20, 2000, 10)])
def test_many_ranks_share_the_point_budget(ranks: int, steps: int, points: int,
                                           each: int) -> None:
    chunk = {"step": [s for s in range(steps) for _ in range(ranks)],
             "rank": list(range(ranks)) * steps,
             **{f: [1.0] * (steps * ranks) for f in series.RANK_FIGURES}}
    assert len(series_fold.ranks_page([chunk], 0, points)["lines"][0]["step"]) == each


def test_a_rank_table_s_sample_is_bounded_and_its_medians_near_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(series_fold, "MEDIAN_SAMPLE", 100)
    values = [float(i % 997) for i in range(10_000)]  # median 498 of every value
    chunks = [{"step": list(range(a, a + 1000)), "rank": [0] * 1000,
               **{f: values[a:a + 1000] for f in series.RANK_FIGURES}}
              for a in range(0, 10_000, 1000)]
    sample = series_fold._Sample(100)
    for c in chunks:
        sample.add(series_fold._floats(c["loss"]))
    assert sample.size <= 200
    (row,) = series_fold.ranks_page(chunks[::-1], 0, 10)["table"]
    assert row["loss"] == pytest.approx(498, abs=25)


@pytest.mark.parametrize(("a", "b", "slow"), [
    (0.100, 0.119, False),  # under 1.2x
    (0.0001, 0.0009, False),  # 9x, but under a millisecond apart
    (0.100, 0.121, True),
])
def test_a_straggler_is_a_clear_margin(a: float, b: float, slow: bool) -> None:
    medians = {r: {**{f: 0.0 for f in series.RANK_FIGURES}, "data_seconds": v}
               for r, v in ((0, a), (1, b))}
    table = series.straggler_table(medians)
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


@pytest.mark.parametrize(("lo", "hi", "points", "index"), [
    (1, 3, 5, [0, 1, 2]),  # fewer steps than points: one a bucket
    (1, 6, 3, [0, 0, 1, 1, 2, 2]),
    (1, 7, 3, [0, 0, 0, 1, 1, 2, 2]),  # equal step widths, 7/3 each
    (10, 12, 2, [0, 0, 1]),
])
def test_a_grid_splits_the_steps_in_equal_widths(lo: int, hi: int, points: int,
                                                 index: list[int]) -> None:
    import numpy as np

    grid = series_fold.Grid(lo, hi, points)
    assert grid.index(np.arange(lo, hi + 1)).tolist() == index
    assert grid.of(hi + 50) == grid.n - 1  # an older life's step past the newest: the last


def test_the_envelope_keeps_a_spike_that_the_mean_hides() -> None:
    loss = [1.0, 1.0, 1.0, 50.0, None, math.nan, 2.0, 2.0]
    cols = {c: list(range(1, 9)) if c in ("step", "time") else loss for c in STEP_COLUMNS}
    env = plain(series_fold.steps_page([cols], 1, points=2))["loss"]
    assert env["hi"][0] == 50.0 and env["lo"][0] == 1.0
    assert env["y"][0] == pytest.approx(53.0 / 4)
    assert env["y"][1] == 2.0  # None and NaN are left out, not counted as zero
    none = {c: [1] if c in ("step", "time") else [None] for c in STEP_COLUMNS}
    assert plain(series_fold.steps_page([none], 1, 5))["loss"] == {
        "y": [None], "lo": [None], "hi": [None]}


def test_downsample_a_long_run_to_a_page() -> None:
    n = 100_000
    cols = {c: list(range(1, n + 1)) if c in ("step", "time") else [float(i % 100) for i in
                                                                   range(n)]
            for c in STEP_COLUMNS}
    # Stored in chunks of 1,000 steps, read newest first.
    chunks = [{c: v[a:a + 1000] for c, v in cols.items()} for a in range(0, n, 1000)][::-1]
    out = plain(series_fold.steps_page(chunks, 1, points=1000))
    assert out["points"] == n and len(out["step"]) == 1000 and out["step"][-1] == n
    assert out["step"][0] == 100  # each point is drawn at its bucket's last step
    assert out["loss"]["lo"][0] == 0.0 and out["loss"]["hi"][0] == 99.0
    short = plain(series_fold.steps_page([{c: [1, 2] for c in STEP_COLUMNS}], 1, points=1000))
    assert short["step"] == [1, 2] and short["loss"] == {"y": [1, 2], "lo": [1, 2], "hi": [1, 2]}
    assert plain(series_fold.steps_page([], 0, 10))["step"] == []


def test_a_redone_stretch_shows_its_newest_figures_once() -> None:
    def chunk(steps: range, loss: float) -> dict:
        return {c: list(steps) if c in ("step", "time") else [loss] * len(steps)
                for c in STEP_COLUMNS}

    # Steps 1-80, then a restart from the step-50 checkpoint that trained 51-100.
    out = plain(series_fold.steps_page([chunk(range(51, 101), 1.0), chunk(range(1, 81), 9.0)],
                                       1, points=100))
    assert out["points"] == 100 and out["step"] == list(range(1, 101))
    assert out["loss"]["y"] == [9.0] * 50 + [1.0] * 50


def test_the_layer_map_is_layers_by_steps_of_the_newest_layout() -> None:
    def chunk(names: list[str], steps: list[int]) -> dict:
        return {"layers": names, "step": steps,
                "grad_norm": [[float(s)] * len(names) for s in steps],
                "update_ratio": [[None] * len(names) for _ in steps]}

    m = plain(series_fold.layers_page([chunk(["a", "b"], [10, 20, 30, 40]), chunk(["x"], [1])],
                                      1, columns=2))
    assert m["layers"] == ["a", "b"] and m["step"] == [20, 40]
    assert m["grad_norm"] == [[15.0, 35.0], [15.0, 35.0]]  # one row per layer
    assert m["update_ratio"] == [[None, None], [None, None]]
    assert series_fold.layers_page([], 0)["layers"] == []


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
    got = plain(again.service.run_series(rid, points=25))
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
    assert plain(again.service.run_series(rid, points=25, ranks=True))["ranks"] == {
        "lines": [], "table": []}
    assert crud.run_chunks(again.engine, run_id=rid, kind=RANK_STEPS) == []
    assert plain(again.service.run_series(rid, points=25, comm=True))["comm"]["ops"] == []


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
    got = plain(node.service.run_series(rid, points=100, ranks=True))
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
    comm = plain(node.service.run_series(rid, points=100, comm=True))["comm"]
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
    stored = {STEPS: [_cols(12)], LAYERS: chunks, RANK_STEPS: ranks, COMM: []}

    def parts(kind: str, newest_first: bool) -> list[dict]:
        return stored[kind][::-1] if newest_first else stored[kind]

    page = series_page(1, parts, lambda kind: 1, evals=[(5, 3.0), (10, 2.5)], points=100,
                       precision=[{"step": 4, "group": "g"}, {"step": 10, "group": "g"}],
                       ranks=True, comm=True, after=10)
    assert page["step"] == [11, 12] and page["after"] == 10
    assert page["evals"] == {"step": [10], "val_loss": [2.5]}  # an eval at 10 may come late
    assert [p["step"] for p in page["precision"]] == [10]
    assert page["layers"] == {"layers": ["a", "b"], "step": [10], "grad_norm": [[3], [4]],
                              "update_ratio": [[0.3], [0.4]]}
    assert [x["step"] for x in page["ranks"]["lines"]] == [[10, 11], [10, 11]]
    assert "table" not in page["ranks"] and page["comm"]["ops"] == []
    whole = plain(series_page(1, parts, lambda kind: 1, evals=[(5, 3.0)], points=100,
                              precision=[]))
    assert whole["points"] == 12 and "after" not in whole and "ranks" not in whole
    assert "comm" not in whole and whole["loss"]["lo"] == whole["loss"]["y"]
