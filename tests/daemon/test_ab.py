
import numpy as np
import pytest

from traind.daemon.experiments.ab import Block, evaluate, log_ratios, measured_pairs, pairs
from traind.daemon.experiments.stats import KINDS, simulate_blocks
from traind.trainer.interleave import arm_index


def blocks_from(base: list[float], arm: list[float], *, losses: tuple[float, float] = (2.0, 2.0)
                ) -> list[Block]:
    """Paired throughputs laid out as the trainer runs them: A B | B A | ..."""
    out = []
    for i, (a, b) in enumerate(zip(base, arm, strict=True)):
        for block in (2 * i, 2 * i + 1):
            name = "A" if arm_index(block, 2) == 0 else "B"
            tps = a if name == "A" else b
            out.append(Block(name, block, tokens=int(tps * 10), seconds=10.0,
                             loss=losses[0] if name == "A" else losses[1]))
    return out


def test_pairs_follow_rounds_for_three_arms():
    names = ["A", "B", "C"]
    blocks = [Block(names[arm_index(b, 3)], b, 100, 1.0, 1.0) for b in range(6)]
    got = pairs(blocks, names, "C")
    assert [(a.block, c.block) for a, c in got] == [(0, 2), (5, 3)]


def test_a_true_speedup_is_called_better():
    base, arm = simulate_blocks(60, speedup=1.10, seed=3)
    result = evaluate(blocks_from(base, arm), ["A", "B"], finished=True, loss_margin=0.05)
    v = result["B"]
    assert v["kind"] == "better", v
    assert v["ratio"] > 1.05 and v["ratio"] < 1.15 and v["low"] < v["ratio"] < v["high"]
    assert "faster" in v["reason"]


def test_carried_pairs_and_this_runs_are_one_stream():
    """A verdict that goes on from an earlier run's pairs (``prior``) reads what one run of
    all the pairs would: the same test, interval and kind; ``carried`` says how many."""
    base, arm = simulate_blocks(40, speedup=1.04, seed=7)
    first, later = blocks_from(base[:15], arm[:15]), blocks_from(base[15:], arm[15:])
    prior = {"B": log_ratios(measured_pairs(first, ["A", "B"], "B"))}
    assert len(prior["B"]) == 15
    carried = evaluate(later, ["A", "B"], finished=True, loss_margin=0.05, prior=prior)["B"]
    whole = evaluate(blocks_from(base, arm), ["A", "B"], finished=True, loss_margin=0.05)["B"]
    assert carried["kind"] == whole["kind"]
    for k in ("ratio", "low", "high", "p_value", "noise", "clipped"):
        assert carried[k] == pytest.approx(whole[k], rel=1e-12), k
    assert (carried["pairs"], carried["carried"]) == (40, 15) and whole["carried"] == 0


def test_a_worse_loss_is_rejected_whatever_the_speed():
    base, arm = simulate_blocks(60, speedup=1.10, seed=3)
    result = evaluate(blocks_from(base, arm, losses=(2.0, 2.3)), ["A", "B"], finished=True,
                      loss_margin=0.05)
    assert result["B"]["kind"] == "rejected (quality)"


def test_running_until_the_test_stops_or_the_run_ends():
    base, arm = simulate_blocks(4, speedup=1.0, seed=1)
    result = evaluate(blocks_from(base, arm), ["A", "B"], finished=False, loss_margin=0.05)
    assert result["B"]["kind"] == "running"
    short = evaluate(blocks_from(base[:1], arm[:1]), ["A", "B"], finished=True,
                     loss_margin=0.05)["B"]  # one pair: a budget too small, said so
    assert short["kind"] == "inconclusive (budget spent)" and "at least 2" in short["reason"]
    final = evaluate(blocks_from(base, arm), ["A", "B"], finished=True, loss_margin=0.05)
    assert final["B"]["kind"] in KINDS and final["B"]["kind"] != "better"


@pytest.mark.parametrize("seed", range(5))
def test_a_over_a_is_not_called_better_or_worse(seed: int):
    base, arm = simulate_blocks(60, speedup=1.0, seed=100 + seed)
    kind = evaluate(blocks_from(base, arm), ["A", "B"], finished=True,
                    loss_margin=0.05)["B"]["kind"]
    assert kind in ("no difference", "inconclusive (budget spent)"), kind


def _with(blocks: list[Block], *, grad_error=None, loss_gap=None) -> list[Block]:
    """The arm's blocks changed: a gradient error per block, or a loss gap per round."""
    import dataclasses

    out = []
    for b in blocks:
        if b.arm == "B":
            rnd = b.block // 2
            if grad_error is not None:
                b = dataclasses.replace(b, grad_error=grad_error(rnd))
            if loss_gap is not None:
                b = dataclasses.replace(b, loss=b.loss + loss_gap(rnd))
        out.append(b)
    return out


def test_gradients_further_than_nothing_or_non_finite_are_rejected():
    base, arm = simulate_blocks(60, speedup=1.10, seed=3)
    fine = evaluate(_with(blocks_from(base, arm), grad_error=lambda r: 0.8), ["A", "B"],
                    finished=True, loss_margin=0.05)["B"]
    assert fine["kind"] == "better" and fine["grad_error"] == pytest.approx(0.8)
    for bad, words in ((1.7, "exceeds 1"), (float("nan"), "not finite")):
        v = evaluate(_with(blocks_from(base, arm), grad_error=lambda r, b=bad: b if r == 7
                           else 0.1), ["A", "B"], finished=True, loss_margin=0.05)["B"]
        assert v["kind"] == "rejected (quality)" and words in v["reason"], v


def test_a_loss_gap_that_grows_is_caught_by_the_trend_check():
    base, arm = simulate_blocks(60, speedup=1.10, seed=3)
    # Mean gap 0.04 < margin 0.05 over all rounds, but 0.07 over the later half.
    growing = _with(blocks_from(base, arm), loss_gap=lambda r: 0.01 if r < 30 else 0.07)
    v = evaluate(growing, ["A", "B"], finished=True, loss_margin=0.05)["B"]
    assert v["kind"] == "rejected (quality)", v
    steady = _with(blocks_from(base, arm), loss_gap=lambda r: 0.01)
    assert evaluate(steady, ["A", "B"], finished=True, loss_margin=0.05)["B"]["kind"] == "better"


def test_a_curved_loss_trend_does_not_reject_an_equal_arm():
    from traind.daemon.experiments.stats import trend_adjusted_gap

    # Both arms on one fast-falling, curved loss curve plus noise: neighbouring blocks differ
    # by the curve far more than by the arms.
    rng = np.random.default_rng(0)

    def curve(b: int) -> float:
        return 2.0 + 3.0 / (1 + b / 3) + rng.normal(0, 0.02)

    base = [(b, curve(b)) for b in range(0, 40, 2)]
    arm = [(b, curve(b)) for b in range(1, 40, 2)]
    q = trend_adjusted_gap(base, arm, margin=0.05)
    assert q.non_inferior and abs(q.diff) < 0.05, q
    worse = [(t, y + 0.1) for t, y in arm]
    assert not trend_adjusted_gap(base, worse, margin=0.05).non_inferior
    with pytest.raises(ValueError, match="more blocks"):
        trend_adjusted_gap(base[:2], arm[:1], margin=0.05)


def test_the_loss_guard_rarely_rejects_equal_arms_and_catches_a_real_gap():
    from traind.daemon.experiments.ab import guard

    rng = np.random.default_rng(7)

    def run(gap: float) -> bool:
        def loss(b: int, extra: float) -> float:
            # 0.025 nats of noise per block: a block's mean over 20 steps' losses here
            return 2.0 + 3.0 / (1 + b / 3) + extra + rng.normal(0, 0.025)
        base = [(b, loss(b, 0.0)) for b in range(0, 40, 2)]
        arm = [(b, loss(b, gap)) for b in range(1, 40, 2)]
        q = guard(base, arm, [0.0] * 20, margin=0.05)
        return q is not None and q.status == "harm"

    equal = sum(run(0.0) for _ in range(200)) / 200
    assert equal <= 0.05, equal
    assert sum(run(0.15) for _ in range(50)) / 50 >= 0.9  # 3x the margin: caught


def _disturb(blocks: list[Block], which: dict[int, float]) -> list[Block]:
    """Blocks ``which`` (index -> factor) slowed by outside load: their seconds times factor."""
    import dataclasses

    return [dataclasses.replace(b, seconds=b.seconds * which[b.block]) if b.block in which
            else b for b in blocks]


def test_one_disturbed_block_does_not_move_an_a_over_a():
    base, arm = simulate_blocks(30, speedup=1.0, cv=0.03, drift=0.05, hiccup=0, seed=11)
    blocks = blocks_from(base, arm)
    clean = evaluate(blocks, ["A", "B"], finished=True, loss_margin=0.05)["B"]
    hit = evaluate(_disturb(blocks, {17: 4.0}), ["A", "B"], finished=True,
                   loss_margin=0.05)["B"]
    assert abs(hit["ratio"] / clean["ratio"] - 1) < 0.01, (clean, hit)
    assert 0.98 < hit["ratio"] < 1.02 and hit["clipped"] >= 1
    assert "clipped" in hit["reason"] and "outside load" in hit["reason"]


def test_two_disturbed_pairs_do_not_hide_a_clear_slowdown():
    base, arm = simulate_blocks(40, speedup=0.90, cv=0.03, drift=0.05, hiccup=0, seed=12)
    blocks = _disturb(blocks_from(base, arm), {6: 4.0, 21: 3.0, 40: 4.0, 61: 3.5})
    v = evaluate(blocks, ["A", "B"], finished=True, loss_margin=0.05)["B"]
    assert v["kind"] == "worse" and 0.87 < v["ratio"] < 0.93, v


def _first_decision(base, arm, **kw) -> tuple[str, int]:
    """Replay the blocks as they arrive: the first decided kind and its pair count."""
    blocks = blocks_from(base, arm)
    for n in range(2, len(base) + 1):
        v = evaluate(blocks[: 2 * n], ["A", "B"], finished=False, loss_margin=0.05, **kw)["B"]
        if v["kind"] != "running":
            return v["kind"], n
    return evaluate(blocks, ["A", "B"], finished=True, loss_margin=0.05, **kw)["B"]["kind"], \
        len(base)


def test_a_quiet_a_over_a_stops_with_no_difference_before_its_budget():
    # Quiet machine: ~2% noise per block (~3% per pair). The +-2% band needs ~30 pairs.
    sims = [simulate_blocks(80, cv=0.02, drift=0.03, hiccup=0.0, seed=s) for s in range(6)]
    got = [_first_decision(b, a) for b, a in sims]
    # Futility (no 2% gain possible) often ends an A/A first: as right, and as final.
    assert all(k in ("no difference", "no gain") and n < 80 for k, n in got), got
    # Without a smallest effect to test against, equivalence is what ends it.
    eq = [_first_decision(b, a, min_effect=0.0) for b, a in sims]
    assert sum(k == "no difference" for k, _ in eq) >= 5, eq


def test_a_clear_effect_stops_early_and_futility_stops_a_useless_arm():
    kind, n = _first_decision(*simulate_blocks(80, speedup=1.15, cv=0.03, seed=21))
    assert kind == "better" and n < 20
    # 1% faster is below the smallest effect worth having (2%): futile once the sequence
    # excludes 2%, without waiting for the budget.
    kind, n = _first_decision(*simulate_blocks(200, speedup=1.0, cv=0.02, drift=0.03,
                                               hiccup=0, seed=22), min_effect=0.05)
    assert kind in ("no gain", "no difference") and n < 60


def test_clipping_keeps_the_always_valid_false_positive_rate():
    """A/A simulations read after every pair, with disturbances (hiccups) as here: the
    clipped test calls a difference at most ~alpha of the time."""
    from traind.daemon.experiments.stats import robust_log_ratios, sequential_test

    false = 0
    runs = 300
    for seed in range(runs):
        base, arm = simulate_blocks(60, cv=0.05, hiccup=0.05, seed=1000 + seed)
        d = np.log(arm / base)
        for n in range(2, d.size + 1):
            if sequential_test(robust_log_ratios(d[:n]).values).stop:
                false += 1
                break
    assert false / runs <= 0.06, false / runs


def test_the_growing_gap_rule_waits_for_enough_blocks_for_a_slope():
    """A/A runs here were rejected on the slope of 7 noisy blocks: the rule now needs
    MIN_TREND_BLOCKS of each arm, then still catches a gap that grows."""
    from traind.daemon.experiments.ab import MIN_TREND_BLOCKS, guard

    rng = np.random.default_rng(3)

    def blocks(n: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        # the arm's gap runs from -0.2 to +0.25 nats: small on average, large at the end
        base = [(2 * i, 3.0 + rng.normal(0, 0.01)) for i in range(n)]
        arm = [(2 * i + 1, 3.0 - 0.2 + 0.45 * i / (n - 1) + rng.normal(0, 0.01))
               for i in range(n)]
        return base, arm

    few = guard(*blocks(MIN_TREND_BLOCKS - 1), [0.0] * 9, margin=0.05)
    assert few is not None and few.measure == "loss (shared weights)", few
    many = guard(*blocks(MIN_TREND_BLOCKS + 4), [0.0] * 14, margin=0.05)
    assert many is not None and many.status == "harm", many
    assert many.measure == "loss gap at the last block"
