"""The pure shaping behind the auto-tune pages (labels, arm names, rounds, queue orders) and
the error mapping of the auto-tune form, as tables of cases."""

from __future__ import annotations

from typing import Any

import pytest

from traind.daemon.autotune.search import Candidate, setting_label
from traind.daemon.config import ConfigError
from traind.daemon.service import QueuedTrial
from traind.web.autotune_views import (
    best_label,
    candidate_name,
    challenger_view,
    queue_rows,
    round_view,
)
from traind.web.errors import field_errors
from traind.web.routes.autotune_pages import tune_errors, tune_field
from traind.web.views import DASH

NONE = {"method": "none"}


@pytest.mark.parametrize(("setting", "label"), [
    ({"precision": "bf16", "compression": {"method": "int8"}, "bucket_mb": None}, "bf16 · int8"),
    ({"precision": "fp32", "compression": {"method": "powersgd", "powersgd_rank": 4}},
     "fp32 · powersgd (rank 4)"),
    ({"precision": "bf16", "compression": NONE, "bucket_mb": 100.0},
     "bf16 · none · bucket 100 MiB"),
    ({"compression": {"method": "topk", "topk_ratio": 0.01}}, "topk (ratio 0.01)"),
    ({"precision": "bf16"}, "bf16"),
    ({"precision": "bf16", "compression": NONE, "mesh": {
        "parallel.dp": 1, "parallel.tp": 2, "parallel.pp": 2, "parallel.strategy": "fsdp"}},
     "bf16 · none · mesh dp 1 \u00d7 tp 2 \u00d7 pp 2 (fsdp)"),
    ({}, DASH),
    (None, DASH),
])
def test_setting_label(setting: Any, label: str) -> None:
    assert setting_label(setting) == label


@pytest.mark.parametrize("candidate", [
    Candidate("bf16", {"method": "int8"}),
    Candidate("fp32", {"method": "powersgd", "powersgd_rank": 4}),
    Candidate("bf16", NONE, 100.0),
    Candidate("fp32", NONE, mesh={"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 2}),
    Candidate("fp32", NONE, 2.5),
    Candidate("bf16", {"method": "topk", "topk_ratio": 0.01, "topk_error_feedback": True}),
    Candidate("fp32", {"method": "powersgd", "powersgd_rank": 16,
                       "powersgd_start_iter": 1000, "powersgd_min_compression": 2}, 25.0),
])
def test_candidate_name_is_the_daemons(candidate: Candidate) -> None:
    # The verdicts of a round are keyed by the daemon's name: the two rules must agree.
    assert candidate_name(candidate.as_dict()) == candidate.name


def test_a_mesh_winner_says_it_was_not_promoted_and_why() -> None:
    best = {"precision": "fp32", "compression": NONE,
            "mesh": {"parallel.dp": 1, "parallel.tp": 2, "parallel.pp": 1},
            "nothing_beat_baseline": False, "needs_restart": "start one with parallel.tp=2"}
    assert best_label(best) == ("fp32 \u00b7 none \u00b7 mesh dp 1 \u00d7 tp 2 \u00d7 pp 1 "
                                "(not promoted: start one with parallel.tp=2)")


def test_candidate_name_prefers_one_the_daemon_gives() -> None:
    assert candidate_name({"name": "x.y", "precision": "bf16", "compression": NONE}) == "x.y"


def test_challenger_views() -> None:
    c = Candidate("bf16", {"method": "int8"}).as_dict()
    assert challenger_view(c, None).kind == "running"
    assert challenger_view(c, None).badge == "running"
    lost = challenger_view(c, {})
    assert lost.kind == "failed (error)" and lost.badge == "failed" and "no verdict" in lost.reason
    v = challenger_view(c, {"bf16.int8": {"kind": "worse", "ratio": 0.9, "low": 0.85,
                                          "high": float("nan")}})
    assert (v.kind, v.badge, v.ratio, v.interval) == ("worse", "failed", "0.900\u00d7", DASH)


def test_round_view() -> None:
    r = round_view({"stage": "compression", "index": 1, "steps": 1600,
                    "baseline": {"precision": "bf16", "compression": NONE},
                    "challengers": [], "experiment_id": None, "verdicts": None})
    assert (r.stage, r.number, r.steps, r.baseline, r.running) == (
        "compression", 2, "1,600", "bf16 · none", True)
    assert r.phase == "speed · interleaved"  # rounds stored before phases existed
    c = Candidate("bf16", {"method": "int8"}).as_dict()
    q = round_view({"stage": "compression", "phase": "quality", "index": 0, "steps": 100,
                    "baseline": {"precision": "bf16", "compression": NONE}, "challengers": [c],
                    "verdicts": {"bf16.int8": {"kind": "rejected (quality)", "ratio": 1.4}}})
    assert q.phase == "quality · forked" and q.number == 1
    (v,) = q.challengers
    assert (v.kind, v.quality, v.quality_badge) == ("rejected (quality)", "harm", "failed")
    assert round_view({"stage": "bucket", "index": 0, "steps": 10, "challengers": [c],
                       "verdicts": None}).phase == "speed · forked"
    assert challenger_view(c, None, quality=True).quality == ""  # running: nothing to read


def trial(i: int) -> QueuedTrial:
    return QueuedTrial(id=i, experiment_id=1, experiment="e", arm="a", repeat=0, priority=i)


@pytest.mark.parametrize(("ids", "ups", "downs"), [
    ([], [], []),
    ([5], [None], [None]),
    ([5, 6, 7], [None, (6, 5), (7, 6)], [(6, 5), (7, 6), None]),
])
def test_queue_rows_post_their_pair_in_its_new_order(
    ids: list[int], ups: list[Any], downs: list[Any]
) -> None:
    rows = queue_rows([trial(i) for i in ids])
    assert [r.up for r in rows] == ups and [r.down for r in rows] == downs


def test_the_queue_panel_is_linear_in_the_queue() -> None:
    # 1,000 waiting trials: each row's buttons name two ids, not the whole order (which made
    # the page quadratic: 406 MB at 1,000 forked experiments).
    rows = queue_rows([trial(i) for i in range(1, 1001)])
    assert sum(len(r.up or ()) + len(r.down or ()) for r in rows) == 2 * 2 * 999


def test_field_errors_nest_under_a_named_candidate() -> None:
    candidate = ConfigError([(("compression", "topk_ratio"), "too big"),
                             (("job", "steps"), "must be > 0")]).within("bf16.topk")
    assert str(candidate) == "bf16.topk: compression.topk_ratio: too big\njob.steps: must be > 0"
    exc = ConfigError([*candidate.errors, (("steps",), "must be at least 1 (got 0)")])
    assert [e["loc"] for e in field_errors(exc)] == [
        ["body", "bf16.topk", "compression", "topk_ratio"],
        ["body", "bf16.topk", "job", "steps"],
        ["body", "steps"],
    ]


@pytest.mark.parametrize(("loc", "field"), [
    (("body", "precisions", 1), "precisions"),
    (("body", "compressions", 0, "method"), "methods"),
    (("body", "target_run_id"), "target_run"),
    (("body", "max_rounds"), "max_rounds"),
    (("body", "fp32.powersgd-rank4", "compression", "powersgd_rank"), "methods"),
    (("body", "fp32", "int8"), "methods"),
    (("body", "bf16.none", "job", "steps"), "precisions"),
    (("body", "bf16.none", "steps"), "steps"),  # its round holds fewer than two pairs
    (("body", "bf16.none.b100"), "precisions"),
    (("body", "fp32.none.dp2tp2", "parallel", "tp"), "mesh"),  # a mesh candidate
    (("body", "bf16.none.pp4"), "mesh"),
    (("body", "mesh"), "mesh"),  # the whole stage
    (("body", "precision"), None),
    (("body", "overrides", "model.n_layers"), None),
    (("body",), None),
])
def test_tune_field(loc: tuple[Any, ...], field: str | None) -> None:
    assert tune_field(loc) == field


def test_tune_errors_keep_the_candidates_name() -> None:
    out = tune_errors([
        {"loc": ["body", "fp32.int8", "compression"], "msg": "bad"},
        {"loc": ["body", "steps"], "msg": "must be > 0"},
        {"loc": ["body", "overrides", "x"], "msg": "unknown key"},
        {"loc": ["body"], "msg": "the queue is full"},
    ])
    assert out == {"methods": ["fp32.int8.compression: bad"], "steps": ["must be > 0"],
                   "": ["overrides.x: unknown key", "the queue is full"]}


def _promotion(**kw: Any) -> Any:
    from datetime import UTC, datetime

    from traind.daemon.service import PromotionView

    base: dict[str, Any] = dict(
        id=1, run_id=3, autotune_id=7, seq=None, state="unchanged",
        setting={"precision": "fp32", "compression": NONE}, previous={"precision": "fp32"},
        evidence={}, applied_step=None, reason="nothing beat the baseline",
        created_at=datetime(2026, 12, 1, tzinfo=UTC), applied_at=None, ended_at=None)
    return PromotionView(**{**base, **kw})


V = {"traind": "0.1", "torch": "2.13", "device": "cpu"}


@pytest.mark.parametrize(("stamps", "shown"), [
    ({}, "job not recorded; evidence none"),  # a row from before migration 0006
    ({"config_hash": "ab" * 32, "versions": V}, "job config abababab \u00b7 device cpu, "
     "torch 2.13, traind 0.1; evidence none"),
    ({"config_hash": "ab" * 32, "versions": V, "evidence_config_hash": "ab" * 32,
      "evidence_versions": V}, "job config abababab \u00b7 device cpu, torch 2.13, "
     "traind 0.1; evidence same"),
    ({"config_hash": "ab" * 32, "versions": V, "evidence_config_hash": "cd" * 32,
      "evidence_versions": V}, "; evidence config cdcdcdcd \u00b7 device cpu"),
])
def test_a_promotion_row_says_what_it_rests_on(stamps: dict[str, Any], shown: str) -> None:
    from traind.web.autotune_views import promotion_row

    row = promotion_row(_promotion(**stamps))
    assert shown in row.basis
    assert row.state == "unchanged" and row.badge == "cancelled"
    assert promotion_row(_promotion(state="odd")).state == "unknown"


def test_the_best_says_when_nothing_beat_the_baseline() -> None:
    from traind.web.autotune_views import best_label

    best = {"precision": "fp32", "compression": NONE, "bucket_mb": None}
    assert best_label(best) == "fp32 \u00b7 none"
    assert best_label({**best, "nothing_beat_baseline": False}) == "fp32 \u00b7 none"
    assert best_label({**best, "nothing_beat_baseline": True}) == \
        "fp32 \u00b7 none (nothing beat the baseline)"
    assert best_label(None) == DASH
