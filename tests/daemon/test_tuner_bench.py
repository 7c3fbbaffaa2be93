"""bench/tuner.py: its --quick path end to end (the real tuner and statistics on the simulated
space), the simulator's truth (a fast harmful arm is never the best) and its cost arithmetic."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from typing import TYPE_CHECKING

import pytest

from tests.conftest import REPO
from traind.daemon.autotune.search import Candidate, Plan, Round

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path
    from types import ModuleType


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "bench"))  # it imports ab_calibration, as a script does
        spec = importlib.util.spec_from_file_location("bench_tuner", REPO / "bench" / "tuner.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
        sys.modules.pop(spec.name, None)


def test_quick_prints_a_row_per_scenario_and_saves_them(
        bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tuner.json"
    rows = bench.main(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "found best (95% CI)" in printed and "decisions per week" in printed
    saved = json.loads(out.read_text())
    assert [r["scenario"] for r in saved["summary"]] == [s.name for s in bench.SCENARIOS]
    for r in rows:
        assert r["searches"] == 3 and len(saved["searches"][r["scenario"]]) == 3
        lo, hi = r["found_ci"]
        assert 0 <= lo <= r["found"] <= hi <= 1
        assert r["steps_median"] > 0 and r["exhaustive_median"] > 0
        assert r["searches_per_week"] > 0
        assert isinstance(r["goal_found"], bool) and isinstance(r["goal_budget"], bool)
        line = next(x for x in printed.splitlines() if x.startswith(r["scenario"] + " "))
        assert ("found pass" if r["goal_found"] else "found FAIL") in line


def test_the_true_best_is_the_fastest_harmless_one_and_worth_a_change(bench: ModuleType) -> None:
    by = {s.name: s for s in bench.SCENARIOS}
    feasible, _ = bench.search.candidates(bench.SPACE, bench.HARDWARE)
    assert len(feasible) == 8  # 2 precisions x 4 compressions, all feasible on 2 DDP ranks

    def best(name: str, **scenario: object) -> str:
        s = dataclasses.replace(by[name], **scenario)
        return bench.key(bench.true_best(s, feasible, margin=0.05, min_effect=0.02))

    s = by["harmful-fastest"]
    assert max(s.ratio, key=s.ratio.get) == "fp32.topk"  # the fastest is harmful...
    assert best("harmful-fastest") == "fp32.int8"  # ...so it is not the best
    assert best("null") == "fp32.none"  # bf16's 1% is not worth a change
    assert best("bf16-wins") == "bf16.powersgd"
    assert best("harmful-fastest", harm={}) == "fp32.topk"  # harmless, it would be
    # the stages choose precision first; the interaction's best is reached by the joint stage
    assert best("interaction") == "fp32.int8"
    staged = bench.staged_best(by["interaction"], feasible, margin=0.05, min_effect=0.02)
    assert bench.key(staged) == "fp32.int8"


def test_a_search_costs_the_steps_its_rounds_used(bench: ModuleType) -> None:
    r = bench.run_search(bench.SCENARIOS[0], bench.Noise(), (0, 0, 0))
    spec = bench.SPEC
    assert r["steps"] == sum(rd["used"] for rd in r["rounds"])
    ran: set[tuple[str, int]] = set()  # (arm, trial steps) a quality round already trained
    quality = [rd for rd in r["rounds"] if rd["phase"] == "quality"]
    assert len(quality) >= 2 and any((rd["baseline"], rd["budget"]) in
                                     {(a, q["budget"]) for q in quality[:i] for a in q["arms"]}
                                     for i, rd in enumerate(quality))  # one took trials
    for rd in r["rounds"]:
        if rd["phase"] == "quality":  # its arms' trials run whole, unless one ran before;
            new = {(a, rd["budget"]) for a in (rd["baseline"], *rd["arms"])} - ran
            base = 10 if not ran else 0  # and the first one's base job makes the checkpoint
            assert rd["used"] == len(new) * spec.quality_repeats * rd["budget"] + base, rd
            ran |= new
        else:  # stopped at a block once every arm is decided, else the whole budget
            assert 0 < rd["used"] <= rd["budget"] and rd["used"] % spec.block_steps == 0
            if "running" in rd["kinds"].values():
                pytest.fail(f"a round ended with an undecided arm: {rd}")


def test_the_exhaustive_schedule_gives_every_candidate_the_most_evidence_of_one(
        bench: ModuleType) -> None:
    base, bf16 = bench.BASE, Candidate("bf16", {"method": "none"})
    int8 = Candidate("fp32", {"method": "int8"})
    rounds = (Round("precision", 0, base, (bf16,), 200),
              Round("compression", 0, base, (int8, bf16), 600),  # 200 per arm
              Round("precision", 2, base, (bf16,), 800),  # the largest: 400 per arm
              Round("precision", 0, base, (bf16,), 300, phase="quality"))
    plan = Plan(best=base, feasible=(), steps=200, rounds=rounds, quality_steps=100)
    # 7 pairwise A/Bs: 2 x 400 interleaved, 2 arms x 2 repeats x 300 forked + a 10-step base
    assert bench.exhaustive_steps(plan, 8, repeats=2) == 7 * (800 + 1200 + 10)
    assert bench.exhaustive_steps(plan, 8, repeats=2, shared=True) == 8 * 400 + 8 * 600 + 10
    no_quality = dataclasses.replace(plan, quality_steps=None)
    assert bench.exhaustive_steps(no_quality, 8, repeats=2) == 7 * 800
    # a round that carried another's pairs rests on both: 300 + 200 steps per arm
    carried = dataclasses.replace(plan, rounds=(
        *rounds, Round("compression", 0, base, (int8, bf16), 900, experiment_id=5),
        Round("compression", 1, base, (int8,), 400, experiment_id=6, carry=(5,))))
    assert bench.exhaustive_steps(carried, 8, repeats=2) == 7 * (1000 + 1200 + 10)
