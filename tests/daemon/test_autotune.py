"""The auto-tuner's decisions, driven by a simulated verdict oracle."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

import pytest

from traind.daemon.autotune.runner import round_spec
from traind.daemon.autotune.search import (
    STAGES,
    Candidate,
    Hardware,
    Plan,
    Round,
    Space,
    candidates,
    first_rounds,
    next_round,
    record,
    start,
)
from traind.daemon.service import AutotuneSpec

if TYPE_CHECKING:
    from collections.abc import Mapping

CPU2 = Hardware(device="cpu", ranks=2, strategy="ddp")
NONE = {"method": "none"}


def test_infeasible_candidates_are_left_out_with_the_reason() -> None:
    space = Space(precisions=("fp32", "bf16", "fp8", "fp16"),
                  compressions=({"method": "int8"},))
    ok, out = candidates(space, CPU2)
    assert {c.name for c in ok} == {"fp32.none", "fp32.int8", "bf16.none", "bf16.int8"}
    reasons = {c.name: r for c, r in out}
    assert "compute capability 8.9" in reasons["fp8.none"] and "cpu" in reasons["fp8.none"]
    assert "loss scaler" in reasons["fp16.int8"]
    # where fp8 can run (here: torchao's emulation), the tuner's own rule leaves it out
    _, out = candidates(space, dataclasses.replace(CPU2, fp8=True))
    reason = dict((c.name, r) for c, r in out)["fp8.none"]
    assert "fp8 cannot switch inside a running job" in reason and "Float8Linear" in reason
    _, out = candidates(space, Hardware(device="cpu", ranks=1, strategy="single"))
    assert "more than one rank" in dict((c.name, r) for c, r in out)["fp32.int8"]
    _, out = candidates(Space(compressions=({"method": "int8"},)),
                        Hardware(device="cpu", ranks=2, strategy="fsdp"))
    assert "ddp or zero1" in dict((c.name, r) for c, r in out)["bf16.int8"]


def _oracle(speed: Mapping[str, float]):
    def judge(baseline: Candidate, c: Candidate) -> dict[str, Any]:
        ratio = speed[c.name] / speed[baseline.name]
        if abs(ratio - 1) <= 0.01:
            kind = "no difference"
        elif ratio > 1.05:
            kind = "better"
        elif ratio < 0.95:
            kind = "worse"
        else:
            kind = "inconclusive (budget spent)"
        return {"kind": kind, "ratio": ratio, "low": ratio - 0.02, "high": ratio + 0.02}
    return judge


def _search(plan: Plan, judge: Any, quality: Any = None) -> tuple[Plan, list[Any]]:
    """Runs the search: speed rounds by ``judge(baseline, candidate)`` (a verdict), quality
    rounds by ``quality(round, candidate)`` (a status)."""
    rounds = []
    while True:
        plan, rnd = next_round(plan)
        if rnd is None:
            return plan, rounds
        rounds.append(rnd)
        if rnd.phase == "quality":
            verdicts = {c.name: _forked(quality(rnd, c)) for c in rnd.challengers}
        else:
            verdicts = {c.name: judge(rnd.baseline, c) for c in rnd.challengers}
        plan = record(plan, rnd, verdicts)
        plan = Plan.from_dict(json.loads(json.dumps(plan.as_dict())))  # as the daemon stores it


def test_stages_pick_precision_then_compression_at_that_precision() -> None:
    space = Space(precisions=("fp32", "bf16"),
                  compressions=(NONE, {"method": "int8"}, {"method": "powersgd",
                                                           "powersgd_rank": 4}))
    ok, _ = candidates(space, CPU2)
    speed = {"fp32.none": 1.0, "bf16.none": 1.3, "fp32.int8": 2.0, "bf16.int8": 1.6,
             "fp32.powersgd-rank4": 0.5, "bf16.powersgd-rank4": 1.2}
    plan, rounds = _search(start(ok, base=Candidate("fp32", NONE), steps=40), _oracle(speed))
    assert [(r.stage, r.baseline.name, [c.name for c in r.challengers]) for r in rounds] == [
        ("precision", "fp32.none", ["bf16.none"]),
        # never a straw man: compression against uncompressed at the chosen precision
        ("compression", "bf16.none", ["bf16.int8", "bf16.powersgd-rank4"]),
        # then what the stages never tried: int8 gains more at fp32 than at bf16
        ("joint", "bf16.int8", ["fp32.int8", "fp32.powersgd-rank4"]),
    ]
    assert plan.best.name == "fp32.int8"


def test_the_joint_stage_leaves_out_harm_and_what_was_tried() -> None:
    space = Space(precisions=("fp32", "bf16", "fp16"),
                  compressions=(NONE, {"method": "int8"}, TOPK))
    ok, _ = candidates(space, dataclasses.replace(CPU2, fp8=True))
    topk = Candidate("fp32", TOPK).name
    speed = {"fp32.none": 1.0, "bf16.none": 0.9, "fp32.int8": 1.2, topk: 1.5,
             Candidate("bf16", TOPK).name: 1.6, "bf16.int8": 1.1}
    plan, rounds = _tuned(start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30),
                          speed, lambda rnd, c: "harm" if c.method == "topk" else "non-inferior")
    assert _shape(rounds)[1:] == [
        ("compression", "speed", "fp32.none", ["fp32.int8", topk], 60, False),  # 3 arms
        ("compression", "quality", "fp32.none", [topk, "fp32.int8"], 30, True),
        # bf16 lost at compression none, yet it may gain more from int8: tried; topk showed
        # harm at fp32 and is paired with nothing (fp16 keeps a scaler: infeasible)
        ("joint", "speed", "fp32.int8", ["bf16.int8"], 40, False),
    ]
    assert plan.best.name == "fp32.int8"
    # a plan stored before the joint stage numbered its stages 0-2 (2: bucket)
    old = {**plan.as_dict(), "stage": 2}
    assert STAGES[Plan.from_dict(old).stage] == "bucket" and plan.as_dict()["stage"] == "done"


def test_successive_halving_keeps_the_better_half_and_doubles_the_budget() -> None:
    methods = ({"method": "int8"}, {"method": "topk", "topk_ratio": 0.1},
               {"method": "fp16"}, {"method": "bf16"})
    ok, _ = candidates(Space(precisions=("fp32",), compressions=methods), CPU2)
    # All within the inconclusive band: nobody is thrown out by a verdict.
    speed = {"fp32.none": 1.0, "fp32.int8": 1.04, "fp32.topk-ratio0.1": 1.03,
             "fp32.fp16": 1.02, "fp32.bf16": 0.97}
    plan, rounds = _search(start(ok, base=Candidate("fp32", NONE), steps=10, max_rounds=3),
                           _oracle(speed))
    # steps per two arms: 10, then 20, then 40 (a round of k arms runs k/2 times that)
    assert [(len(r.challengers), r.steps) for r in rounds] == [(4, 25), (2, 30), (1, 40)]
    assert [c.name for c in rounds[1].challengers] == ["fp32.int8", "fp32.topk-ratio0.1"]
    assert plan.best.name == "fp32.none"  # nothing proved better: the baseline stays


def test_a_winner_becomes_the_baseline_and_the_others_face_it() -> None:
    methods = ({"method": "int8"}, {"method": "fp16"}, {"method": "bf16"})
    ok, _ = candidates(Space(precisions=("fp32",), compressions=methods), CPU2)
    verdicts = iter([
        {"fp32.int8": {"kind": "better", "ratio": 1.2}, "fp32.fp16": {"kind": "better",
         "ratio": 1.1}, "fp32.bf16": {"kind": "rejected (quality)", "ratio": 1.3}},
        {"fp32.fp16": {"kind": "worse", "ratio": 0.9}},
    ])
    plan = start(ok, base=Candidate("fp32", NONE), steps=10)
    plan, rnd = next_round(plan)
    assert rnd is not None
    plan = record(plan, rnd, next(verdicts))
    assert plan.best.name == "fp32.int8"
    plan, rnd = next_round(plan)
    assert rnd is not None and rnd.baseline.name == "fp32.int8"
    assert [c.name for c in rnd.challengers] == ["fp32.fp16"]
    plan = record(plan, rnd, next(verdicts))
    plan, rnd = next_round(plan)
    assert rnd is None and plan.best.name == "fp32.int8"


def test_bucket_stage_varies_the_bucket_with_the_winners_settings() -> None:
    ok, _ = candidates(Space(precisions=("fp32", "bf16"), compressions=(NONE,),
                             bucket_mb=(1.0, 100.0)), CPU2)
    speed = {"fp32.none": 1.0, "bf16.none": 1.2, "bf16.none.b1": 1.0,
             "bf16.none.b100": 1.3}
    plan, rounds = _search(start(ok, base=Candidate("fp32", NONE), steps=10), _oracle(speed))
    assert rounds[-1].stage == "bucket"
    assert [c.name for c in rounds[-1].challengers] == ["bf16.none.b1", "bf16.none.b100"]
    assert plan.best.name == "bf16.none.b100" and plan.best.arm()["bucket_mb"] == 100.0


def test_a_missing_verdict_counts_as_a_failure() -> None:
    ok, _ = candidates(Space(precisions=("fp32",), compressions=({"method": "int8"},)), CPU2)
    plan, rnd = next_round(start(ok, base=Candidate("fp32", NONE), steps=10))
    assert rnd is not None
    plan = record(plan, rnd, {})
    assert plan.survivors == ()
    assert next_round(plan)[1] is None


def test_names_are_arm_names_and_stay_unique_when_cut() -> None:
    pattern = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
    a = Candidate("fp32", {"method": "powersgd", "powersgd_rank": 4, "powersgd_start_step": 10,
                           "powersgd_min_compression": 2})
    b = Candidate("fp32", {"method": "powersgd", "powersgd_rank": 4, "powersgd_start_step": 10,
                           "powersgd_min_compression": 3})
    assert pattern.match(a.name) and pattern.match(b.name) and a.name != b.name


def test_bad_budgets_name_the_field() -> None:
    with pytest.raises(ValueError, match="steps"):
        start([], base=Candidate("fp32", NONE), steps=0)
    with pytest.raises(ValueError, match="max_rounds"):
        start([], base=Candidate("fp32", NONE), steps=5, max_rounds=0)


# --- quality rounds: speed by interleaving, quality by forking -------------------------------


def _forked(status: str, ratio: float = 1.0) -> dict[str, Any]:
    """A forked trial verdict with this quality status (its speed is the trials' own)."""
    kind = {"harm": "rejected (quality)", "non-inferior": "inconclusive (budget spent)",
            "not shown": "not shown (budget spent)"}[status]
    return {"kind": kind, "ratio": ratio, "quality": {"status": status}}


def _tuned(plan: Plan, speed: Mapping[str, float], quality: Any) -> tuple[Plan, list[Any]]:
    return _search(plan, _oracle(speed), quality)


def _shape(rounds: list[Any]) -> list[tuple[str, str, str, list[str], int, bool]]:
    return [(r.stage, r.phase, r.baseline.name, [c.name for c in r.challengers], r.steps,
             r.forked) for r in rounds]


TOPK = {"method": "topk", "topk_ratio": 0.01, "error_feedback": False}


def test_a_faster_arm_wins_only_after_a_forked_quality_round() -> None:
    space = Space(precisions=("fp32", "bf16"), compressions=(NONE, {"method": "int8"}, TOPK))
    ok, _ = candidates(space, CPU2)
    # top-k without error feedback is the fastest and harms the model; int8 is fast and fine
    topk = Candidate("bf16", TOPK).name
    speed = {"fp32.none": 1.0, "bf16.none": 1.3, "bf16.int8": 1.5, topk: 2.0, "fp32.int8": 1.2}
    plan, rounds = _tuned(
        start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30), speed,
        lambda rnd, c: "harm" if c.name == topk else "non-inferior")
    assert _shape(rounds) == [
        ("precision", "speed", "fp32.none", ["bf16.none"], 40, False),
        ("precision", "quality", "fp32.none", ["bf16.none"], 30, True),
        ("compression", "speed", "bf16.none", ["bf16.int8", topk], 60, False),  # 3 arms
        # the fastest first; each on its own weights
        ("compression", "quality", "bf16.none", [topk, "bf16.int8"], 30, True),
        ("joint", "speed", "bf16.int8", ["fp32.int8"], 40, False),  # topk showed harm
    ]
    assert rounds[3].speed == {topk: 2.0 / 1.3, "bf16.int8": 1.5 / 1.3}
    assert plan.best.name == "bf16.int8"  # the fastest that passed, not the fastest


def test_quality_not_shown_gets_a_longer_round_and_then_leaves() -> None:
    ok, _ = candidates(Space(precisions=("fp32", "bf16"), compressions=(NONE,)), CPU2)
    speed = {"fp32.none": 1.0, "bf16.none": 1.3}
    answers = iter(["not shown", "non-inferior"])
    plan, rounds = _tuned(start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30),
                          speed, lambda rnd, c: next(answers))
    assert [(r.phase, r.index, r.steps) for r in rounds] == [
        ("speed", 0, 40), ("quality", 0, 30), ("quality", 1, 60)]
    assert plan.best.name == "bf16.none"
    # never shown within max_rounds quality rounds: out, and the baseline stays (it says so)
    plan, rounds = _tuned(start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30,
                                max_rounds=2), speed, lambda rnd, c: "not shown")
    assert [(r.phase, r.steps) for r in rounds] == [("speed", 40), ("quality", 30),
                                                    ("quality", 60)]
    assert plan.best.name == "fp32.none" and plan.awaiting == ()


def test_a_failed_quality_round_is_no_evidence_and_keeps_the_best() -> None:
    ok, _ = candidates(Space(precisions=("fp32", "bf16"), compressions=(NONE,)), CPU2)
    plan = start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30)
    plan, rnd = next_round(plan)
    assert rnd is not None
    plan = record(plan, rnd, {"bf16.none": {"kind": "better", "ratio": 1.3}})
    plan, rnd = next_round(plan)
    assert rnd is not None and rnd.phase == "quality"
    plan = record(plan, rnd, {})  # the experiment was lost
    assert plan.best.name == "fp32.none" and plan.awaiting == ()
    assert next_round(plan)[1] is None


def test_quality_rounds_share_one_checkpoint_and_a_fresh_winners_trials_start_short() -> None:
    """Every quality round names the search's earlier ones (their checkpoint and trials are
    taken: daemon/experiments/reuse.py); a trial doubles for a challenger whose quality a
    shorter one did not show, not for the next winner after another's quality round."""
    ok, _ = candidates(Space(precisions=("fp32", "bf16"), compressions=(
        NONE, {"method": "int8"}, TOPK)), CPU2)
    topk = Candidate("bf16", TOPK).name
    plan = start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30)
    script = [  # (phase, challengers, reuse, steps, verdicts)
        ("speed", ["bf16.none"], (), 40, {"bf16.none": {"kind": "better", "ratio": 1.3}}),
        ("quality", ["bf16.none"], (), 30, {"bf16.none": _forked("non-inferior")}),
        ("speed", ["bf16.int8", topk], (), 60, {
            topk: {"kind": "better", "ratio": 1.6},
            "bf16.int8": {"kind": "inconclusive (budget spent)", "ratio": 1.03}}),
        ("quality", [topk], (11,), 30, {topk: _forked("harm")}),
        ("speed", ["bf16.int8"], (), 80, {"bf16.int8": {"kind": "better", "ratio": 1.04}}),
        ("quality", ["bf16.int8"], (11, 12), 30, {"bf16.int8": _forked("not shown")}),
        ("quality", ["bf16.int8"], (11, 12, 13), 60, {"bf16.int8": _forked("non-inferior")}),
    ]
    quality_ids = iter(range(11, 20))
    for phase, names, reuse, steps, verdicts in script:
        plan, rnd = next_round(plan)
        assert rnd is not None
        assert (rnd.phase, [c.name for c in rnd.challengers], rnd.reuse, rnd.steps) == (
            phase, names, reuse, steps)
        if phase == "quality":
            rnd = dataclasses.replace(rnd, experiment_id=next(quality_ids))
        rnd = Round.from_dict(json.loads(json.dumps(rnd.as_dict())))  # as the daemon stores it
        plan = record(plan, rnd, verdicts)
    assert plan.best.name == "bf16.int8"
    assert round_spec(AutotuneSpec(name="t"), 1, plan.rounds[-1]).reuse == (11, 12, 13)


def test_a_speed_round_carries_the_pairs_of_the_stages_rounds_against_the_same_best() -> None:
    """Each arm's pairs with the best double from round to round, and those an earlier round
    against the same best measured count (``Round.carry``: the verdict goes on from them), so a
    round runs the difference; a new best starts afresh: nobody measured it yet."""
    ok, _ = candidates(Space(precisions=("fp32", "bf16"), compressions=(
        NONE, {"method": "int8"}, {"method": "fp16"}, TOPK)), CPU2)
    topk = Candidate("bf16", TOPK).name
    plan = start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30)
    inconclusive = {"kind": "inconclusive (budget spent)", "ratio": 1.03}
    script = [  # (phase, baseline, challengers, carry, steps, verdicts)
        ("speed", "fp32.none", ["bf16.none"], (), 40,
         {"bf16.none": {"kind": "better", "ratio": 1.3}}),
        ("quality", "fp32.none", ["bf16.none"], (), 30, {"bf16.none": _forked("non-inferior")}),
        # 4 arms, 20 steps per arm (40 per two)
        ("speed", "bf16.none", ["bf16.int8", "bf16.fp16", topk], (), 80, {
            topk: {"kind": "better", "ratio": 1.6}, "bf16.int8": inconclusive,
            "bf16.fp16": inconclusive}),
        ("quality", "bf16.none", [topk], (), 30, {topk: _forked("harm")}),
        # 40 per arm in all, 20 of them carried: 3 arms x 20
        ("speed", "bf16.none", ["bf16.int8", "bf16.fp16"], (3,), 60, {
            "bf16.int8": {"kind": "better", "ratio": 1.04}, "bf16.fp16": inconclusive}),
        ("quality", "bf16.none", ["bf16.int8"], (), 30, {"bf16.int8": _forked("non-inferior")}),
        # a new best: fp16 faces it with no pairs carried, 80 per arm (its third round)
        ("speed", "bf16.int8", ["bf16.fp16"], (), 160, {"bf16.fp16": inconclusive}),
    ]
    for i, (phase, base, names, carry, steps, verdicts) in enumerate(script, start=1):
        plan, rnd = next_round(plan)
        assert rnd is not None
        assert (rnd.phase, rnd.baseline.name, [c.name for c in rnd.challengers], rnd.carry,
                rnd.steps) == (phase, base, names, carry, steps), i
        rnd = Round.from_dict(json.loads(json.dumps(  # as the daemon stores it
            dataclasses.replace(rnd, experiment_id=i).as_dict())))
        assert round_spec(AutotuneSpec(name="t"), 1, rnd).carry == carry
        plan = record(plan, rnd, verdicts)
    assert plan.best.name == "bf16.int8"


def test_passed_arms_that_were_not_the_fastest_face_the_new_best() -> None:
    ok, _ = candidates(Space(precisions=("fp32",), compressions=(
        NONE, {"method": "int8"}, {"method": "fp16"})), CPU2)
    speed = {"fp32.none": 1.0, "fp32.int8": 1.5, "fp32.fp16": 1.2}
    plan, rounds = _tuned(start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30),
                          speed, lambda rnd, c: "non-inferior")
    assert _shape(rounds)[2:] == [
        ("compression", "speed", "fp32.int8", ["fp32.fp16"], 80, False)]
    assert plan.best.name == "fp32.int8"


def test_forked_stages_need_no_quality_round() -> None:
    ok, _ = candidates(Space(precisions=("fp32",), compressions=(NONE,),
                             bucket_mb=(100.0,)), CPU2)
    plan, rounds = _tuned(start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30),
                          {"fp32.none": 1.0, "fp32.none.b100": 1.3},
                          lambda rnd, c: pytest.fail("no quality round in a forked stage"))
    assert _shape(rounds) == [("bucket", "speed", "fp32.none", ["fp32.none.b100"], 40, True)]
    assert plan.best.name == "fp32.none.b100"


def test_first_rounds_are_the_largest_experiments_of_each_stage() -> None:
    ok, _ = candidates(Space(precisions=("fp32", "bf16"), compressions=(
        NONE, {"method": "int8"}, {"method": "fp16"}), bucket_mb=(100.0,)), CPU2)
    plan = start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=30)
    assert [(r.stage, r.phase, len(r.challengers), r.steps) for r in first_rounds(plan)] == [
        ("precision", "speed", 1, 40), ("precision", "quality", 1, 30),
        # an interleaved round's budget is per arm: 3 arms, 3/2 of a two-arm round's
        ("compression", "speed", 2, 60), ("compression", "quality", 2, 30),
        ("joint", "speed", 2, 60), ("joint", "quality", 2, 30),
        ("bucket", "speed", 1, 40)]  # forked: steps per trial
    with pytest.raises(ValueError, match="quality_steps"):
        start(ok, base=Candidate("fp32", NONE), steps=40, quality_steps=0)


def test_the_joint_stage_chases_an_inconclusive_arm_like_any_stage() -> None:
    space = Space(precisions=("fp32", "bf16"), compressions=(NONE, {"method": "int8"}))
    ok, _ = candidates(space, CPU2)
    # bf16 wins alone; int8 at fp32 is a little faster than bf16: inconclusive, and measured
    # faster, so it is chased for max_rounds rounds, twice the steps each
    speed = {"fp32.none": 1.0, "bf16.none": 1.3, "bf16.int8": 1.3, "fp32.int8": 1.33}
    plan, rounds = _search(start(ok, base=Candidate("fp32", NONE), steps=40, max_rounds=3),
                           _oracle(speed))
    assert [(r.stage, r.index, [c.name for c in r.challengers], r.steps) for r in rounds] == [
        ("precision", 0, ["bf16.none"], 40), ("compression", 0, ["bf16.int8"], 40),
        ("joint", 0, ["fp32.int8"], 40), ("joint", 1, ["fp32.int8"], 80),
        ("joint", 2, ["fp32.int8"], 160)]
    assert plan.best.name == "bf16.none"


def test_an_inconclusive_arm_measured_no_faster_than_the_best_leaves() -> None:
    ok, _ = candidates(Space(precisions=("fp32",), compressions=({"method": "int8"},)), CPU2)
    plan = start(ok, base=Candidate("fp32", NONE), steps=40, max_rounds=3)
    plan, rnd = next_round(plan)
    assert rnd is not None and rnd.challengers[0].name == "fp32.int8"
    inconclusive = {"kind": "inconclusive (budget spent)", "low": 0.9, "high": 1.1}
    # measured slower (inside its interval): not worth a round of twice the steps
    done, nxt = next_round(record(plan, rnd, {"fp32.int8": {**inconclusive, "ratio": 0.99}}))
    assert nxt is None and done.best.name == "fp32.none"
    # measured faster, or not measured at all (no ratio): it may yet be better
    for ratio in (1.01, None):
        _, nxt = next_round(record(plan, rnd, {"fp32.int8": {**inconclusive, "ratio": ratio}}))
        assert nxt is not None and (nxt.index, nxt.steps) == (1, 80)
