"""bench/ab_calibration.py's pure parts: the interval, the replay of saved blocks through the
daemon's verdict, the noise figures and the JSON round trip (the real runs are the bench's)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests.conftest import REPO

if TYPE_CHECKING:
    from pathlib import Path
    from types import ModuleType


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    path = REPO / "bench" / "ab_calibration.py"
    spec = importlib.util.spec_from_file_location("bench_ab_calibration", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def synthetic(*, ratio: float, n_blocks: int = 40, cv: float = 0.03, seed: int = 0,
              block_steps: int = 20) -> dict[str, Any]:
    """A saved experiment as the bench writes one: ABBA blocks whose arm b takes ``ratio``
    times a's seconds (noise ``cv`` per block), both arms on one falling loss curve."""
    rng = np.random.default_rng(seed)
    blocks = []
    for i in range(n_blocks):
        arm = "ab"[i % 2 if (i // 2) % 2 == 0 else 1 - i % 2]
        seconds = 2.0 * (ratio if arm == "b" else 1.0) * math.exp(rng.normal(0, cv))
        loss = 2.0 + 2.0 * math.exp(-i / 10) + rng.normal(0, 0.01)
        blocks.append({"arm": arm, "block": i, "step": (i + 1) * block_steps, "steps": 17,
                       "tokens": 17_408, "seconds": seconds, "loss": loss, "grad_error": 0.0,
                       "time": 100.0 + 2.5 * (i + 1), "val_loss": loss - 0.1})
    return {"group": "aa" if ratio == 1 else "planted", "index": 0, "seed": seed,
            "arms": ["a", "b"], "slowdown": 0.0, "steps": n_blocks * block_steps,
            "block_steps": block_steps, "warmup_steps": 3, "loss_margin": 0.05,
            "completed": True, "launched": 95.0, "ended": 100.0 + 2.5 * n_blocks + 1,
            "blocks": blocks}


@pytest.mark.parametrize(("k", "n", "low", "high"), [
    (0, 20, 0.0, 0.1684),  # the rule of three's exact twin: 1 - 0.025 ** (1 / 20)
    (1, 20, 0.00127, 0.2487),
    (8, 10, 0.4439, 0.9748),
    (10, 10, 0.6915, 1.0),
])
def test_clopper_pearson(bench: ModuleType, k: int, n: int, low: float, high: float) -> None:
    lo, hi = bench.clopper_pearson(k, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_clopper_pearson_refuses_impossible_counts(bench: ModuleType) -> None:
    for k, n in ((3, 2), (-1, 5), (0, 0)):
        with pytest.raises(ValueError, match="0 <= k <= n"):
            bench.clopper_pearson(k, n)


def test_a_planted_slowdown_is_found_early_and_the_right_way(bench: ModuleType) -> None:
    slow = bench.replay(synthetic(ratio=1.3))  # b takes 1.3x the time: b is worse
    assert slow.kind == "worse" and slow.early
    assert slow.step == slow.blocks * 20 < 800 and slow.seconds == pytest.approx(
        5.0 + 2.5 * slow.blocks)  # from the launch to the deciding block's event
    fast = bench.replay(synthetic(ratio=1 / 1.3))
    assert fast.kind == "better" and fast.early
    assert fast.verdict["ratio"] == pytest.approx(1.3, rel=0.05)


def test_the_replay_can_turn_futility_off(bench: ModuleType) -> None:
    """A 6% slowdown that "worse" does not reach in the budget ends "no gain" (futility);
    replayed with min_effect 0 the same blocks never do: the two-sided test's power."""
    kinds = {bench.replay(synthetic(ratio=1.06, cv=0.05, seed=s)).kind for s in range(6)}
    off = [bench.replay(synthetic(ratio=1.06, cv=0.05, seed=s), min_effect=0.0)
           for s in range(6)]
    assert "no gain" in kinds
    assert {r.kind for r in off} <= {"worse", "inconclusive (budget spent)"}
    assert "worse" in {r.kind for r in off}
    assert "replayed with min_effect 0" in bench.report(
        {"experiments": [synthetic(ratio=1.06)]}, min_effect=0.0)


def test_identical_arms_stay_undecided_until_the_budget(bench: ModuleType) -> None:
    for seed in range(3):
        r = bench.replay(synthetic(ratio=1.0, seed=seed))
        assert r.kind not in bench.SPEED_CLAIMS and r.kind != bench.RUNNING
        assert not r.early and r.step == 800 and r.blocks == 40


def test_a_record_cut_short_is_judged_unfinished(bench: ModuleType) -> None:
    exp = {**synthetic(ratio=1.0), "completed": False}
    assert bench.replay(exp).kind == bench.RUNNING  # never "done" with a running verdict
    exp["blocks"] = exp["blocks"][:1]
    assert bench.replay(exp).kind == bench.RUNNING


def test_pair_figures_and_pooled_noise(bench: ModuleType) -> None:
    figs = bench.pair_figures(synthetic(ratio=1.3, cv=0.0))
    assert len(figs["log_ratio"]) == 20
    assert all(x == pytest.approx(-math.log(1.3)) for x in figs["log_ratio"])
    # b - a within each round: round 0 is A B on a falling curve, round 1 is B A.
    assert figs["loss"][0] < 0 < figs["loss"][1] and len(figs["loss"]) == 20
    assert figs["val_loss"] == pytest.approx(figs["loss"])  # val = loss - 0.1 in each block
    # Each group centred on its own mean: a constant effect per experiment is not noise.
    sd, robust, n = bench.pooled_sd([[1.0, 1.2, 0.8], [5.0, 5.2, 4.8], [9.0]])
    assert n == 6 and sd == pytest.approx(0.2) and robust == pytest.approx(0.2 * 1.4826)
    assert math.isnan(bench.pooled_sd([[1.0]])[0])


def test_the_record_survives_a_json_round_trip(bench: ModuleType, tmp_path: Path) -> None:
    exp = synthetic(ratio=1.3)
    exp["blocks"][3]["loss"] = None  # NaN in the worker: null in JSON, NaN again in a Block
    data = {"schema": bench.SCHEMA, "settings": {}, "experiments": [exp, synthetic(ratio=1)]}
    path = tmp_path / "calib.json"
    bench.save(path, data)
    back = bench.load(path)
    assert back == data
    assert math.isnan(bench.to_block(back["experiments"][0]["blocks"][3]).loss)
    assert bench.replay(back["experiments"][0]) == bench.replay(exp)
    kept = tmp_path / "calib.json.gz"  # as bench/results/ keeps them
    kept.write_bytes(gzip.compress(path.read_bytes()))
    assert bench.load(kept) == data
    text = bench.report(back)
    assert "false positives   0/1" in text and "power (worse)     1/1" in text
    path.write_text('{"schema": 99}')
    with pytest.raises(SystemExit, match="schema 99"):
        bench.load(path)


def test_the_schedule_mixes_the_groups(bench: ModuleType) -> None:
    order = bench.schedule(4, 2)
    assert sorted(order) == ["aa"] * 4 + ["planted"] * 2
    assert order[:3].count("planted") == 1  # spread, not all at the end


def test_saved_runs_pool_in_launch_order(bench: ModuleType, tmp_path: Path) -> None:
    """``--replay a b`` judges two runs' blocks as one (more A/As: a narrower interval)."""
    def saved(name: str, launched: list[float]) -> Path:
        exps = [{**synthetic(ratio=1.0, seed=i), "launched": t, "group": "aa"}
                for i, t in enumerate(launched)]
        path = tmp_path / name
        path.write_text(json.dumps({"schema": bench.SCHEMA, "settings": {"steps": 800},
                                    "experiments": exps}))
        return path

    data = bench.pooled([saved("a.json", [10.0, 30.0]), saved("b.json", [20.0])])
    assert [e["launched"] for e in data["experiments"]] == [10.0, 20.0, 30.0]
    assert [p["file"] for p in data["pooled"]] == [str(tmp_path / "a.json"),
                                                   str(tmp_path / "b.json")]
    assert "false positives" in bench.report(data)
