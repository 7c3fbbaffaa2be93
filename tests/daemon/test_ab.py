
import numpy as np
import pytest

from traind.daemon.experiments.ab import Block, evaluate, pairs
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


def test_a_worse_loss_is_rejected_whatever_the_speed():
    base, arm = simulate_blocks(60, speedup=1.10, seed=3)
    result = evaluate(blocks_from(base, arm, losses=(2.0, 2.3)), ["A", "B"], finished=True,
                      loss_margin=0.05)
    assert result["B"]["kind"] == "rejected (quality)"


def test_running_until_the_test_stops_or_the_run_ends():
    base, arm = simulate_blocks(4, speedup=1.0, seed=1)
    result = evaluate(blocks_from(base, arm), ["A", "B"], finished=False, loss_margin=0.05)
    assert result["B"]["kind"] == "running"
    assert evaluate(blocks_from(base[:1], arm[:1]), ["A", "B"], finished=True,
                    loss_margin=0.05)["B"]["kind"] == "running"  # one pair: nothing to say
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
        return q is not None and not q.non_inferior

    equal = sum(run(0.0) for _ in range(200)) / 200
    assert equal <= 0.05, equal
    assert sum(run(0.15) for _ in range(50)) / 50 >= 0.9  # 3x the margin: caught
