"""daemon/experiments/stats.py: hand-checkable tables, simulated A/A calibration, power,
properties.

Simulated noise (``simulate_blocks`` defaults, measured on this machine): 5% lognormal noise
per block, a slow drift of 10% amplitude that ABBA pairing cancels, and 1 block in 50 hit by
another tenant (10-40% slower). The calibration and power tests print their figures (``pytest -s``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy import stats as sst

from traind.daemon.experiments.stats import (
    DEFAULT_BUDGET_BLOCKS,
    KINDS,
    Interval,
    NonInferiority,
    SequentialResult,
    interval_of,
    non_inferior,
    sequential_test,
    simulate_blocks,
    speedup,
    verdict,
)

E = math.exp
T3 = 3.182446305284263  # t quantile, 0.975, 3 df
T2 = 4.302652729749464  # t quantile, 0.975, 2 df
T2_95 = 2.919985580355516  # t quantile, 0.95, 2 df


# --- speedup: tables -----------------------------------------------------------------------

SPEEDUP_CASES = [
    # (name, baseline, arm, paired, method, ratio, low, high)
    ("identical, paired", [100, 90, 110, 95], [100, 90, 110, 95], True, "welch", 1, 1, 1),
    ("identical, bootstrap", [100, 90, 110, 95], [100, 90, 110, 95], True, "bootstrap", 1, 1, 1),
    ("constant +10%, paired", [100, 80, 120, 90], [110, 88, 132, 99], True, "welch",
     1.1, 1.1, 1.1),
    ("constant +10%, bootstrap", [100, 80, 120, 90], [110, 88, 132, 99], True, "bootstrap",
     1.1, 1.1, 1.1),
    # log ratios .1 .3 .1 .3: mean .2, sd .11547, se .057735, t(3) interval
    ("paired t by hand", [1, 1, 1, 1], [E(.1), E(.3), E(.1), E(.3)], True, "welch",
     E(.2), E(.2 - T3 * .057735027), E(.2 + T3 * .057735027)),
    # log means .1 vs .2, variances .02 each: se .141421, Welch df 2
    ("welch by hand", [1, E(.2)], [E(.1), E(.3)], False, "welch",
     E(.1), E(.1 - T2 * .141421356), E(.1 + T2 * .141421356)),
    ("halved", [200, 200, 200], [100, 100, 100], False, "welch", 0.5, 0.5, 0.5),
]


@pytest.mark.parametrize("name,base,arm,paired,method,ratio,low,high", SPEEDUP_CASES,
                         ids=[c[0] for c in SPEEDUP_CASES])
def test_speedup_table(name, base, arm, paired, method, ratio, low, high):
    iv = speedup(base, arm, paired=paired, method=method)
    assert iv.ratio == pytest.approx(ratio, rel=1e-9)
    assert iv.low == pytest.approx(low, rel=1e-6)
    assert iv.high == pytest.approx(high, rel=1e-6)
    assert iv.method == method and iv.paired == paired
    assert iv.n == (len(base) if paired else len(base) + len(arm))


def test_constant_ten_percent_under_noise_is_narrow():
    base, _ = simulate_blocks(20, seed=3)
    rng = np.random.default_rng(0)
    arm = base * 1.10 * np.exp(rng.normal(0, 0.002, base.size))  # 0.2% measurement jitter
    iv = speedup(base, arm, paired=True)
    assert iv.ratio == pytest.approx(1.10, rel=0.002)
    assert iv.high - iv.low < 0.005


def test_pairing_removes_drift_from_the_interval():
    base, arm = simulate_blocks(40, speedup=1.05, cv=0.02, drift=0.15, hiccup=0, seed=1)
    paired = speedup(base, arm, paired=True)
    unpaired = speedup(base, arm, paired=False)
    assert paired.low > 1.0 > unpaired.low  # the drift hides the 5% unless blocks are paired
    assert (paired.high - paired.low) < 0.5 * (unpaired.high - unpaired.low)


def test_bootstrap_agrees_with_t_and_is_reproducible():
    base, arm = simulate_blocks(40, speedup=1.05, seed=2)
    t = speedup(base, arm, paired=True)
    b1 = speedup(base, arm, paired=True, method="bootstrap", seed=7)
    b2 = speedup(base, arm, paired=True, method="bootstrap", seed=7)
    assert b1 == b2
    assert b1.ratio == pytest.approx(t.ratio)
    assert b1.low == pytest.approx(t.low, rel=0.01) and b1.high == pytest.approx(t.high, rel=0.01)
    u = speedup(base, arm, paired=False, method="bootstrap")
    assert u.low < u.ratio < u.high


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("method", ["welch", "bootstrap"])
def test_the_p_beside_an_interval_comes_from_the_same_test(paired, method):
    """The page shows one interval and one p: the interval excludes 1 exactly when p <= 5%
    (a bootstrap's p and percentile interval agree up to its resampling, at the boundary)."""
    disagree = 0
    for seed in range(60):
        base, arm = simulate_blocks(8, speedup=1.0 + (seed % 6) * 0.01, seed=seed)
        iv = speedup(base, arm, paired=paired, method=method, seed=seed, resamples=4000)
        excludes = iv.low > 1 or iv.high < 1
        disagree += excludes != (iv.p_value <= 0.05)
        if method == "welch":
            assert excludes == (iv.p_value <= 0.05), (seed, iv)
    assert disagree <= 2
    assert "t interval" in speedup(base, arm, paired=paired).name


def test_a_confidence_sequence_carries_the_sequential_p():
    base, arm = simulate_blocks(30, speedup=1.08, seed=4)
    logs = np.log(arm / base)
    seq = sequential_test(logs.tolist())
    iv = interval_of(seq, logs.tolist())
    assert iv.p_value == seq.p_value and iv.name == "95% always-valid confidence sequence"
    v = verdict(speed=iv, sequential=seq, budget_spent=True)
    assert v.p_value == seq.p_value and v.interval == iv.name and "95% CS" in v.reason


@pytest.mark.parametrize("kwargs,msg", [
    (dict(baseline=[1, 2, 3], arm=[1, 2], paired=True), "paired"),
    (dict(baseline=[1], arm=[1], paired=True), "at least 2"),
    (dict(baseline=[1, 0], arm=[1, 2], paired=True), "> 0"),
    (dict(baseline=[1, math.nan], arm=[1, 2], paired=True), "finite"),
    (dict(baseline=[1, 2], arm=[1, 2], paired=True, method="magic"), "method"),
    (dict(baseline=[1, 2], arm=[1, 2], paired=True, confidence=1.0), "confidence"),
])
def test_speedup_refuses_bad_input(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        speedup(**kwargs)


# --- speedup: properties -------------------------------------------------------------------

tput = st.floats(min_value=1.0, max_value=1e6, allow_nan=False)
pairs = st.integers(2, 30).flatmap(
    lambda n: st.tuples(st.lists(tput, min_size=n, max_size=n),
                        st.lists(tput, min_size=n, max_size=n)))
methods = st.sampled_from(["welch", "bootstrap"])


@settings(max_examples=60, deadline=None)
@given(pairs, st.booleans(), methods)
def test_interval_contains_the_estimate(data, paired, method):
    base, arm = data
    iv = speedup(base, arm, paired=paired, method=method, resamples=500)
    assert iv.low <= iv.ratio <= iv.high


@settings(max_examples=60, deadline=None)
@given(pairs, st.booleans())
def test_swapping_arms_inverts_the_ratio(data, paired):
    base, arm = data
    ab = speedup(base, arm, paired=paired)
    ba = speedup(arm, base, paired=paired)
    assert ab.ratio == pytest.approx(1 / ba.ratio, rel=1e-9)
    assert ab.low == pytest.approx(1 / ba.high, rel=1e-9)
    assert ab.high == pytest.approx(1 / ba.low, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(pairs, st.booleans(), methods, st.floats(min_value=1e-3, max_value=1e3))
def test_scaling_every_throughput_changes_nothing(data, paired, method, c):
    base, arm = data
    one = speedup(base, arm, paired=paired, method=method, resamples=500)
    scaled = speedup([c * x for x in base], [c * x for x in arm], paired=paired, method=method,
                     resamples=500)
    for f in ("ratio", "low", "high"):
        assert getattr(scaled, f) == pytest.approx(getattr(one, f), rel=1e-7, abs=1e-12)


# --- sequential test -----------------------------------------------------------------------


def test_sequential_small_cases_by_hand():
    empty = sequential_test([])
    assert (empty.p_value, empty.stop, empty.n, empty.stopped_at) == (1.0, False, 0, None)
    one = sequential_test([0.3])  # one pair says nothing about its own noise
    assert one.bayes_factor == pytest.approx(1.0) and one.p_value == 1.0
    sym = sequential_test([0.1, -0.1], tau=1.0)  # mean 0: BF = (1 + 2 tau^2)^(-1/2)
    assert sym.bayes_factor == pytest.approx(1 / math.sqrt(3)) and not sym.stop
    zeros = sequential_test([0.0] * 10)
    assert zeros.p_value == 1.0 and not zeros.stop


def test_bayes_factor_matches_its_integral():
    """The closed form equals the mixture over delta ~ N(0, tau^2) with the 1/sigma prior."""
    x = np.array([0.31, -0.12, 0.55, 0.08, 0.27])
    g = 0.7

    def lik(delta: float, sig: float) -> float:
        return float(np.prod(sst.norm.pdf(x, delta * sig, sig)))

    num = integrate.dblquad(lambda s, d: lik(d, s) * sst.norm.pdf(d, 0, math.sqrt(g)) / s,
                            -10, 10, 1e-3, 20, epsabs=1e-12)[0]
    den = integrate.quad(lambda s: lik(0, s) / s, 1e-3, 20, epsabs=1e-12)[0]
    assert sequential_test(x, tau=math.sqrt(g)).bayes_factor == pytest.approx(num / den,
                                                                              rel=1e-4)


def test_clear_signal_stops_early_and_stopped_at_is_the_first_look():
    rng = np.random.default_rng(0)
    x = 0.05 + rng.normal(0, 0.02, 30)
    full = sequential_test(x)
    assert full.stop and full.stopped_at is not None and full.stopped_at < 10
    firsts = [k for k in range(1, 31) if sequential_test(x[:k]).stop]
    assert firsts[0] == full.stopped_at
    assert firsts == list(range(full.stopped_at, 31))  # the always-valid p never rises
    assert full.low > 1.0 and full.low < math.exp(x.mean()) < full.high


@settings(max_examples=60, deadline=None)
# Values at least 1e-300 from zero: a subnormal scaled by c < 1 rounds to zero (5e-324 * 0.5
# is 0.0), which changes the data, not just its scale.
@given(st.lists(st.floats(-1, 1).filter(lambda v: v == 0 or abs(v) >= 1e-300),
                min_size=2, max_size=40), st.floats(0.01, 100))
def test_sequential_is_scale_invariant(x, c):
    a, b = sequential_test(x), sequential_test([c * v for v in x])
    assert b.p_value == pytest.approx(a.p_value, rel=1e-6, abs=1e-12)
    assert b.stop == a.stop or math.isclose(a.p_value, 0.05, rel=1e-6)


def test_sequential_refuses_bad_input():
    for kwargs in (dict(alpha=0), dict(tau=0)):
        with pytest.raises(ValueError):
            sequential_test([0.1, 0.2], **kwargs)
    with pytest.raises(ValueError, match="finite"):
        sequential_test([0.1, math.inf])


# --- non-inferiority -----------------------------------------------------------------------

NI_CASES = [
    # (name, baseline, arm, paired, margin, diff, upper, non_inferior)
    # d = .01 .03 .02: mean .02, sd .01, se .0057735, one-sided t(2, .95)
    ("paired within margin", [1, 1, 1], [1.01, 1.03, 1.02], True, 0.05,
     0.02, 0.02 + T2_95 * 0.0057735027, True),
    ("paired bound above margin", [1, 1, 1], [1.01, 1.03, 1.02], True, 0.03,
     0.02, 0.02 + T2_95 * 0.0057735027, False),
    ("identical, margin 0 is strict", [2.0, 2.1], [2.0, 2.1], True, 0.0, 0.0, 0.0, False),
    ("identical, any margin", [2.0, 2.1], [2.0, 2.1], True, 0.01, 0.0, 0.0, True),
    ("arm better", [2.5, 2.6, 2.4], [2.0, 2.1, 1.9], True, 0.01, -0.5, -0.5, True),
    # unpaired: means 2.05 vs 2.0, variances .005 each: se .070711, df 2
    ("welch", [1.95, 2.05], [2.0, 2.1], False, 0.5, 0.05, 0.05 + T2_95 * 0.070710678, True),
]


@pytest.mark.parametrize("name,base,arm,paired,margin,diff,upper,ok", NI_CASES,
                         ids=[c[0] for c in NI_CASES])
def test_non_inferior_table(name, base, arm, paired, margin, diff, upper, ok):
    r = non_inferior(base, arm, margin=margin, paired=paired)
    assert r.diff == pytest.approx(diff, abs=1e-12)
    assert r.upper == pytest.approx(upper, rel=1e-6, abs=1e-12)
    assert r.non_inferior is ok and r.margin == margin


def test_non_inferior_refuses_bad_input():
    with pytest.raises(ValueError, match="margin"):
        non_inferior([1, 2], [1, 2], margin=-0.1, paired=True)
    with pytest.raises(ValueError, match="paired"):
        non_inferior([1, 2, 3], [1, 2], margin=0.1, paired=True)
    with pytest.raises(ValueError, match="at least 2"):
        non_inferior([1], [1], margin=0.1, paired=False)


# --- verdict -------------------------------------------------------------------------------

FAST = Interval(1.31, 1.27, 1.35, 14, "welch")
SLOW = Interval(0.91, 0.89, 0.93, 14, "welch")
TIGHT = Interval(1.002, 0.995, 1.008, 40, "welch")
WIDE = Interval(1.012, 0.98, 1.045, 40, "welch")
UNPAIRED_FAST = Interval(1.08, 1.03, 1.13, 12, "welch", paired=False)


def seq(p: float) -> SequentialResult:
    return SequentialResult(p, p <= 0.05, 14, 14 if p <= 0.05 else None, 1 / p, 0.9, 1.5)


OK = NonInferiority(0.004, 0.012, True, 0.05, 14)
UNSHOWN = NonInferiority(0.031, 0.062, False, 0.05, 14, lower=0.0)  # straddles the margin
HARM = NonInferiority(0.09, 0.12, False, 0.05, 14, lower=0.06)  # shown worse than the margin

VERDICT_CASES = [
    # (name, kwargs, kind)
    ("error wins over everything", dict(speed=FAST, sequential=seq(0.003), quality=OK,
                                        error="worker exited 1"), "failed (error)"),
    ("error before any block", dict(speed=None, error="no such precision"), "failed (error)"),
    ("harm shown", dict(speed=FAST, sequential=seq(0.003), quality=HARM), "rejected (quality)"),
    ("harm shown before the speed test decides", dict(speed=WIDE, sequential=seq(0.4),
                                                      quality=HARM), "rejected (quality)"),
    ("harm shown at the budget", dict(speed=TIGHT, sequential=seq(0.8), quality=HARM,
                                      budget_spent=True), "rejected (quality)"),
    ("quality not shown is no rejection", dict(speed=FAST, sequential=seq(0.003),
                                               quality=UNSHOWN), "better"),
    ("quality required and not shown", dict(speed=UNPAIRED_FAST, quality=UNSHOWN,
                                            budget_spent=True, quality_required=True),
     "not shown (budget spent)"),
    ("quality required and unmeasured", dict(speed=UNPAIRED_FAST, budget_spent=True,
                                             quality_required=True), "not shown (budget spent)"),
    ("quality required and shown", dict(speed=UNPAIRED_FAST, quality=OK, budget_spent=True,
                                        quality_required=True), "better"),
    ("slower needs no quality", dict(speed=SLOW, sequential=seq(0.001), quality=UNSHOWN,
                                     quality_required=True), "worse"),
    ("faster", dict(speed=FAST, sequential=seq(0.003), quality=OK), "better"),
    ("faster, quality unchecked", dict(speed=FAST, sequential=seq(0.003)), "better"),
    ("slower", dict(speed=SLOW, sequential=seq(0.001), quality=OK), "worse"),
    ("equivalent at the budget", dict(speed=TIGHT, sequential=seq(0.9), quality=OK,
                                      budget_spent=True), "no difference"),
    ("equivalent before the budget: it stops", dict(speed=TIGHT, sequential=seq(0.9)),
     "no difference"),
    ("futile before the budget: it stops", dict(speed=Interval(0.99, 0.965, 1.015, 40, "cs"),
                                                 sequential=seq(0.5)), "no gain"),
    ("futile and looking slower, at the budget", dict(
        speed=Interval(0.97, 0.93, 1.015, 40, "cs"), sequential=seq(0.5), budget_spent=True),
     "no gain"),
    ("unclear at the budget", dict(speed=WIDE, sequential=seq(0.2), quality=OK,
                                   budget_spent=True), "inconclusive (budget spent)"),
    ("p just above alpha", dict(speed=FAST, sequential=seq(0.0501), budget_spent=True),
     "inconclusive (budget spent)"),
    ("narrower band: futile, not equivalent", dict(speed=TIGHT, sequential=seq(0.9),
                                                   budget_spent=True, equivalence=0.005),
     "no gain"),
    ("narrower band, any gain worth having", dict(speed=TIGHT, sequential=seq(0.9),
                                                  budget_spent=True, equivalence=0.005,
                                                  min_effect=0.0),
     "inconclusive (budget spent)"),
    ("unpaired, judged once at the budget", dict(speed=UNPAIRED_FAST, budget_spent=True),
     "better"),
]


@pytest.mark.parametrize("name,kwargs,kind", VERDICT_CASES, ids=[c[0] for c in VERDICT_CASES])
def test_verdict_table(name, kwargs, kind):
    v = verdict(**kwargs)
    assert v.kind == kind and v.kind in KINDS
    speed = kwargs["speed"]
    if speed is not None:
        assert (v.ratio, v.low, v.high) == (speed.ratio, speed.low, speed.high)
    assert v.quality is kwargs.get("quality")
    assert "\n" not in v.reason and v.reason


def test_verdict_reason_reads_like_the_design():
    v = verdict(speed=FAST, sequential=seq(0.003), quality=OK)
    assert v.reason == ("B is 1.310x faster than A (95% CI 1.270\u20131.350, always-valid p "
                        "0.003, 14 pairs), loss non-inferior (\u0394 +0.004, 95% bounds "
                        "-inf..+0.012 < margin 0.05 nats)")
    assert v.p_value == 0.003
    w = verdict(speed=SLOW, sequential=seq(0.001), arm="int8", baseline="none")
    assert w.reason.startswith("int8 is 9.0% slower than none (ratio 0.910")
    r = verdict(speed=FAST, sequential=seq(0.003), quality=HARM)
    assert "worse by more than the margin" in r.reason and "lower bound > 0.05" in r.reason
    u = verdict(speed=FAST, sequential=seq(0.003), quality=UNSHOWN, note="1 of 14 pairs clipped")
    assert "straddle the margin" in u.reason and u.reason.endswith("; 1 of 14 pairs clipped")


def test_quality_status_three_ways():
    assert OK.status == "non-inferior" and HARM.status == "harm"
    assert UNSHOWN.status == "not shown"
    # The numbers that sank bf16 and int8 in a 200-step round: lower loss than the baseline,
    # an upper bound over the margin for want of blocks. Not shown, never harm.
    q = non_inferior([3.0, 3.1, 2.9, 3.05], [2.98, 3.09, 2.86, 3.03], margin=0.05,
                     paired=False)
    assert q.diff < 0 and q.status == "not shown"
    worse = non_inferior([3.0, 3.01, 2.99, 3.0], [3.2, 3.21, 3.19, 3.2], margin=0.05,
                         paired=True)
    assert worse.status == "harm" and worse.lower > 0.05


@pytest.mark.parametrize("kwargs", [
    dict(speed=WIDE, sequential=seq(0.2)),  # still running
    dict(speed=UNPAIRED_FAST),  # unpaired trials are judged only at the budget
    dict(speed=None, budget_spent=True),  # nothing measured and no error
])
def test_no_verdict_before_its_time(kwargs):
    with pytest.raises(ValueError):
        verdict(**kwargs)


# --- simulation ----------------------------------------------------------------------------


def test_simulation_shapes_reproducibility_and_effect():
    b, a = simulate_blocks(40, speedup=1.05, seed=4)
    assert b.shape == a.shape == (40,) and np.all(b > 0)
    b2, a2 = simulate_blocks(40, speedup=1.05, seed=4)
    assert np.array_equal(b, b2) and np.array_equal(a, a2)
    b, a = simulate_blocks(4000, speedup=1.05, seed=5)
    assert np.exp(np.log(a / b).mean()) == pytest.approx(1.05, rel=0.005)


def test_abba_cancels_the_drift():
    b, a = simulate_blocks(40, cv=1e-6, drift=0.2, hiccup=0, seed=6)
    assert np.log(b).std() > 0.05  # the machine wanders ...
    assert abs(np.log(a / b).mean()) < 0.002  # ... and the pairs do not see it


# --- A/A calibration and power -------------------------------------------------------------


def run_experiment(base: np.ndarray, arm: np.ndarray, budget: int) -> str:
    """What the scheduler does: a look after every block, a verdict at the stop or budget."""
    lr = np.log(arm / base)
    for n in range(2, budget + 1):
        s = sequential_test(lr[:n])
        if s.stop or n == budget:
            iv = speedup(base[:n], arm[:n], paired=True)
            return verdict(speed=iv, sequential=s, budget_spent=n == budget).kind
    raise AssertionError("unreachable")


def tolerance(p: float, n: int) -> float:
    return p + 3 * math.sqrt(p * (1 - p) / n)


def test_aa_false_positive_rate_is_at_most_alpha():
    n, budget = 1000, DEFAULT_BUDGET_BLOCKS
    kinds = [run_experiment(*simulate_blocks(budget, seed=10_000 + s), budget) for s in range(n)]
    fpr = sum(k in ("better", "worse") for k in kinds) / n
    print(f"\nA/A: false-positive rate {fpr:.3f} over {n} experiments of up to {budget} blocks "
          f"(looks after every block)")
    assert fpr <= tolerance(0.05, n)


def test_peeking_at_a_fixed_horizon_t_test_inflates_false_positives():
    """Why the sequential test exists: the same A/A data, a plain paired t-test every block."""
    n, budget = 1000, DEFAULT_BUDGET_BLOCKS
    hits = 0
    for s in range(n):
        b, a = simulate_blocks(budget, seed=10_000 + s)
        lr = np.log(a / b)
        # every look's one-sample t test at once (scipy's ttest_1samp per prefix, vectorised)
        k = np.arange(1, budget + 1)
        mean = np.cumsum(lr) / k
        var = (np.cumsum(lr * lr) - k * mean * mean) / np.maximum(k - 1, 1)
        t = mean[1:] / np.sqrt(np.maximum(var[1:], 1e-300) / k[1:])
        hits += bool(np.any(2 * sst.t.sf(np.abs(t), k[1:] - 1) < 0.05))
    fpr = hits / n
    print(f"\nA/A, naive t-test peeked at every block: false-positive rate {fpr:.3f} over {n}")
    assert fpr > tolerance(0.05, n)


def test_a_true_five_percent_speedup_is_found():
    n, budget = 400, DEFAULT_BUDGET_BLOCKS
    kinds = [run_experiment(*simulate_blocks(budget, speedup=1.05, seed=20_000 + s), budget)
             for s in range(n)]
    power = kinds.count("better") / n
    print(f"\npower: 5% speedup declared better in {power:.3f} of {n} experiments "
          f"within {budget} blocks; declared worse in {kinds.count('worse')}")
    assert power >= 0.80
    assert "worse" not in kinds


def test_always_valid_over_a_long_horizon_of_gaussian_noise():
    """No budget at all: 200 looks at pure Gaussian A/A noise still stay under alpha.

    One call per experiment suffices: ``stopped_at`` is the first look at which a scheduler
    looking after every block would have stopped (checked above)."""
    n, looks = 2000, 200
    rng = np.random.default_rng(30)
    x = rng.normal(0.0, 0.07, (n, looks))
    fpr = sum(sequential_test(row).stop for row in x) / n
    print(f"\nA/A, Gaussian noise, {looks} looks: false-positive rate {fpr:.4f} over {n}")
    assert fpr <= tolerance(0.05, n)


def test_an_arm_that_looks_slower_runs_on_to_worse_rather_than_stop_at_no_gain() -> None:
    """Futility ends a run early only while the estimate is within min_effect below 1: an arm
    estimated 3% slower, its interval's top under 1.02, is not decided yet (worse is a pair or
    two away); with min_effect 4% the same interval looks like no change and stops there."""
    slower = Interval(0.97, 0.93, 1.015, 40, "cs")
    with pytest.raises(ValueError, match="no verdict yet"):
        verdict(speed=slower, sequential=seq(0.5))
    assert verdict(speed=slower, sequential=seq(0.5), min_effect=0.04).kind == "no gain"
