"""The statistics behind an A/B verdict: pure functions, plain numbers in, frozen records out.

No torch, no database, no I/O: the scheduler measures, this module decides, and the tests in
``tests/daemon/test_stats.py`` check it with tables of hand-checkable cases and with simulated
experiments (A/A calibration and power).

Throughput (tokens/s, higher is better) is analysed on the log scale, so a speedup is a ratio
and swapping the arms inverts it exactly, and multiplying every figure by a constant (tokens per
step, a faster machine) changes nothing.

**Speedup interval** (``speedup``). The estimate is the ratio of geometric means, arm/baseline:
``exp(mean(log arm) - mean(log baseline))``. At a few percent of noise per block this equals the
ratio of arithmetic means to within ~cv^2/2 (0.1% at cv 4%), and unlike that ratio it is exactly
symmetric under swapping the arms. Paired (interleaved blocks in ABBA order, or forked trials
paired by repeat): a t interval on the mean of the per-pair log ratios, exponentiated; the pairing
removes the machine's slow drift, which is most of the variance on a shared host. Unpaired:
Welch's interval on the difference of mean log throughputs (Welch-Satterthwaite degrees of
freedom). ``method="bootstrap"``: a percentile interval of the same estimate from resampling
pairs (or each arm separately), with a fixed seed so a verdict can be reproduced.

**Sequential test** (``sequential_test``): the scheduler looks after every block and wants to
stop as soon as the answer is clear. Looking after every block and stopping at the first
p < 0.05 of a fixed-horizon t-test declares a difference between identical arms in about a
quarter of A/A experiments of 40 blocks (``tests/daemon/test_stats.py`` shows it), not 5%. We use
an always-valid p-value instead (Johari, Pekelis, Walsh 2017, "Always valid inference"): a
mixture sequential probability ratio test on the paired log ratios, with a normal mixture over
the effect. Johari et al. plug in an estimate of the noise's variance, which is only valid
asymptotically and is anti-conservative over the first few blocks, exactly where an eager
scheduler looks. So the mixture is placed over the *standardised* effect ``delta = mean / sd``
(``delta ~ N(0, tau^2)``) with the scale-invariant (right Haar, 1/sigma) prior on the unknown
sd. The resulting Bayes factor has a closed form in the one-sample t statistic (Rouder et al.
2009, eq. 1 at fixed g = tau^2)::

    BF_n = (1 + n g)^(-1/2) * [ sum(x^2) / (SS + n xbar^2 / (1 + n g)) ]^(n/2)

and under "no difference" it is a nonnegative martingale (Perez-Ortiz, Lardy, de Heide,
Grunwald 2024, "E-statistics, group invariance and anytime-valid testing"), so by Ville's
inequality P(BF_n >= 1/alpha for some n) <= alpha: the always-valid p-value
``min_k 1/BF_k`` may be read after every block, and stopping whenever it drops below alpha keeps
the false-positive rate below alpha with no planned number of looks. (A group-sequential design
with O'Brien-Fleming spending would also do, but fixes the looks in advance; the scheduler's
block count depends on the budget in minutes.) Inverting the same test around each candidate
mean gives an always-valid confidence sequence for the ratio, reported beside the p-value.
``tau`` is the effect, in units of the per-pair noise, the test is most eager to find; the
default 0.75 suits a 5% speedup at this machine's ~5% noise per block (per-pair sd ~7-9%);
power is flat for tau in 0.5-1.0.

**Robust pairing** (``robust_log_ratios``): a block disturbed by outside load (another
tenant's burst, a host stall) gives one pair a huge log ratio; pairs beyond the median +- 3
robust sd (MAD x 1.4826) are clipped to that edge before either test reads them, and the
verdict says how many were. One 4x-slow block then moves an A/A by ~0.5%, not ~5%.

**Quality guard** (``non_inferior``): the arm's loss (lower is better; or any lower-is-better
fidelity figure) may exceed the baseline's by at most ``margin``, an absolute amount in the
loss's units (nats). Three outcomes (``NonInferiority.status``): ``non-inferior`` (one-sided
upper bound below the margin), ``harm`` (one-sided lower bound above the margin: shown worse)
and ``not shown`` (the interval straddles the margin: lack of data, not evidence of harm).
Only harm rejects; a candidate whose quality is not shown is kept for a longer round. Quality
is judged on weights of the arm's own (forked trials from one checkpoint, the same data, the
validation loss on a fixed held-out set): arms interleaved in one job share one model, so harm
one arm does spreads into the other's blocks, and the interleaved guard is an early alarm only.

**Verdict** (``verdict``), in this order:

1. an error was reported -> ``failed (error)``;
2. the quality check shows harm -> ``rejected (quality)``;
3. the test is significant (sequential: always-valid p <= alpha; without a sequential test, at
   the budget: the fixed interval excludes 1): ``worse`` if the ratio < 1; if > 1, ``better``,
   or ``not shown (budget spent)`` where quality is required and not shown;
4. the interval lies within the equivalence band ``[1/(1+eq), 1+eq]`` (eq = 2% by default)
   -> ``no difference``;
5. the interval's upper end is below ``1 + min_effect`` (the smallest speed-up worth having,
   2% by default) -> ``no gain`` (futility: the arm cannot be worth a change); before the
   budget only while the estimate is within ``min_effect`` below 1 (an arm that looks slower
   runs on to ``worse``);
6. otherwise, budget spent -> ``inconclusive (budget spent)``.

With a sequential test, 3-5 are read after every pair on the always-valid confidence sequence,
so an experiment stops as soon as any of them holds; without one, once, at the budget.
Asking for a verdict before the test stops or the budget is spent is a ``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

Method = Literal["welch", "bootstrap"]
Kind = Literal["better", "worse", "no difference", "no gain", "inconclusive (budget spent)",
               "not shown (budget spent)", "rejected (quality)", "failed (error)"]
KINDS: tuple[str, ...] = get_args(Kind)
# The kinds that end an arm: the speed test decided (better, worse), its confidence sequence
# showed equivalence or futility (no difference, no gain), or harm was shown.
DECIDED: frozenset[str] = frozenset({"better", "worse", "no difference", "no gain",
                                     "rejected (quality)", "failed (error)"})
# A quality check's outcome (NonInferiority.status).
Status = Literal["non-inferior", "harm", "not shown"]

DEFAULT_TAU = 0.75
DEFAULT_ALPHA = 0.05
DEFAULT_BUDGET_BLOCKS = 60  # pairs; a 5% speedup at the measured noise is found ~88% of the time
DEFAULT_MIN_EFFECT = 0.02  # the smallest speed-up worth a change (futility stops below it)
DEFAULT_EQUIVALENCE = 0.02  # the "no difference" band (relative)
# The per-pair noise (sd of the log ratios) assumed where a node has measured none yet:
# bench/ab_calibration.py measured 0.061-0.063 (robust) and 0.084-0.125 (plain) on the default
# job here, quiet; 0.08 is between, the figure bench/tuner.py simulates.
DEFAULT_PAIR_NOISE = 0.08
# How far an A/A's estimate may wander, in standard errors, inside the band reachable_band
# chooses. Simulated A/As through ab.evaluate (2% of blocks hit, tests/daemon/test_bands.py):
# at 1.0 only 55-60% ended "no difference" within the budget (the sequence's own variance
# estimate and the clipped hits widen it past the known-noise half-width); at 2.5, 86-91% at
# 10-24 pairs (noise 0.061-0.08), and at 100 pairs 75%, the rest but 3% "no gain" first.
BAND_WANDER = 2.5
# Robust pairing: a pair further than this many robust standard deviations (MAD x 1.4826) from
# the median log ratio is clipped to that distance (a block disturbed by outside load), once
# there are enough pairs to estimate the spread.
CLIP_SIGMAS = 3.0
CLIP_MIN_PAIRS = 6


@dataclass(frozen=True)
class Interval:
    """A speedup ratio (arm / baseline, > 1: the arm is faster) with its confidence interval."""

    ratio: float
    low: float
    high: float
    n: int  # pairs when paired, else observations of both arms together
    method: str  # "welch" (a paired t interval when paired) or "bootstrap"
    paired: bool = True
    confidence: float = 0.95
    # Two-sided p of "no difference" from the same test as the interval (the t test the
    # interval inverts; a bootstrap's share of resampled means on the far side of 0, doubled),
    # so p <= 1 - confidence exactly when the interval excludes 1. A confidence sequence
    # carries the always-valid p of the sequential test it inverts. None: not computed.
    p_value: float | None = None

    @property
    def name(self) -> str:
        """What the interval is, as a page names it beside its p-value."""
        if self.method == "confidence sequence":
            return f"{self.confidence:.0%} always-valid confidence sequence"
        if self.method == "bootstrap":
            return f"{self.confidence:.0%} bootstrap interval" + (" (paired)" * self.paired)
        return f"{self.confidence:.0%} " + ("paired t interval" if self.paired
                                             else "Welch t interval")


@dataclass(frozen=True)
class SequentialResult:
    """An always-valid test of "no difference" on paired log ratios, after ``n`` of them."""

    p_value: float  # always-valid: min over looks 1..n of 1/BF, at most 1
    stop: bool  # p_value <= alpha: the difference is established
    n: int
    stopped_at: int | None  # first look at which p_value reached alpha
    bayes_factor: float  # BF_n at this look (an e-value)
    low: float  # always-valid (1 - alpha) confidence sequence for the ratio, at look n
    high: float


@dataclass(frozen=True)
class NonInferiority:
    """Loss of arm minus baseline (> 0: the arm is worse) against the allowed margin."""

    diff: float
    upper: float  # one-sided upper confidence bound of diff
    non_inferior: bool  # upper < margin
    margin: float  # absolute, in the measure's units (nats for a loss)
    n: int
    confidence: float = 0.95
    measure: str = "loss"  # or "gradient error": the interleaved fidelity guard's bound
    lower: float = -math.inf  # one-sided lower confidence bound of diff
    shown_harm: bool = False  # harm shown by a rule of its own (a growing gap, a broken bound)

    @property
    def status(self) -> Status:
        """``non-inferior`` (upper bound under the margin), ``harm`` (lower bound above it: the
        arm is shown worse by more than the margin) or ``not shown`` (the interval straddles
        the margin: more data would tell)."""
        if self.non_inferior:
            return "non-inferior"
        return "harm" if self.shown_harm or self.lower > self.margin else "not shown"


@dataclass(frozen=True)
class Verdict:
    kind: str  # one of KINDS
    ratio: float  # nan when unknown (a failure before any measurement)
    low: float
    high: float
    p_value: float | None  # from the test the interval inverts (always-valid when sequential)
    quality: NonInferiority | None
    reason: str  # one line for a person
    interval: str = ""  # what low..high is (Interval.name): the page says it beside p


def student_t() -> Any:
    """scipy's Student t distribution, imported on first use: ``scipy.stats`` is 0.8 s of
    every daemon start, and a daemon computes no interval until an experiment reports."""
    from scipy import stats

    return stats.t


# --- speedup -------------------------------------------------------------------------------


def _logs(xs: Sequence[float], name: str) -> np.ndarray:
    a = np.asarray(xs, dtype=float)
    if a.ndim != 1 or a.size < 2:
        raise ValueError(f"{name}: need at least 2 throughput figures, got {a.size}")
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{name}: throughput must be finite and > 0")
    return np.log(a)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must lie in (0, 1), got {confidence}")


def _t_bounds(est: float, se: float, df: float, q: float) -> tuple[float, float]:
    if se == 0:  # every pair agrees exactly: nothing to widen
        return est, est
    h = float(student_t().ppf(q, df)) * se
    return est - h, est + h


def _t_p(est: float, se: float, df: float) -> float:
    """Two-sided p of the t test whose interval :func:`_t_bounds` gives."""
    if se == 0:
        return 1.0 if est == 0 else 0.0
    return float(min(1.0, 2 * student_t().sf(abs(est) / se, df)))


def speedup(baseline: Sequence[float], arm: Sequence[float], *, paired: bool,
            confidence: float = 0.95, method: Method = "welch", seed: int = 0,
            resamples: int = 10_000) -> Interval:
    """Arm/baseline throughput ratio with a ``confidence`` interval (see the module docstring).

    ``paired``: ``baseline[i]`` and ``arm[i]`` are the i-th pair of adjacent blocks (or trials).
    """
    _check_confidence(confidence)
    if method not in get_args(Method):
        raise ValueError(f"method: must be one of {get_args(Method)}, got {method!r}")
    lb, la = _logs(baseline, "baseline"), _logs(arm, "arm")
    q = 0.5 + confidence / 2
    rng = np.random.default_rng(seed)
    if paired:
        if lb.size != la.size:
            raise ValueError(f"paired: baseline has {lb.size} blocks, arm {la.size}")
        d = la - lb
        n, est = d.size, float(d.mean())
        if method == "welch":
            se = float(d.std(ddof=1)) / math.sqrt(n)
            lo, hi = _t_bounds(est, se, n - 1, q)
            p = _t_p(est, se, n - 1)
        else:
            boots = d[rng.integers(0, n, (resamples, n))].mean(axis=1)
    else:
        n, est = lb.size + la.size, float(la.mean() - lb.mean())
        if method == "welch":
            va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
            se = math.sqrt(va + vb)
            df = (va + vb) ** 2 / (va**2 / (la.size - 1) + vb**2 / (lb.size - 1)) if se else 1.0
            lo, hi = _t_bounds(est, se, df, q)
            p = _t_p(est, se, df)
        else:
            boots = (la[rng.integers(0, la.size, (resamples, la.size))].mean(axis=1)
                     - lb[rng.integers(0, lb.size, (resamples, lb.size))].mean(axis=1))
    if method == "bootstrap":
        lo, hi = (float(v) for v in np.quantile(boots, [1 - q, q]))
        # Resampled means of identical pairs can differ from the estimate in the last bit.
        lo, hi = min(lo, est), max(hi, est)
        far = float(np.mean(boots <= 0)) if est > 0 else float(np.mean(boots >= 0))
        p = min(1.0, 2 * far)
    return Interval(math.exp(est), math.exp(lo), math.exp(hi), n, method, paired, confidence,
                    p_value=p)


# --- robust pairing ------------------------------------------------------------------------


@dataclass(frozen=True)
class RobustPairs:
    """Paired log ratios with the disturbed ones clipped (see :func:`robust_log_ratios`)."""

    values: np.ndarray  # the log ratios the tests read
    clipped: int  # how many were clipped
    noise: float  # robust sd of the raw log ratios (MAD x 1.4826); nan below 2 pairs
    bound: float  # the clip distance from the median (inf: nothing clipped yet)

    @property
    def rule(self) -> str:
        """The rule as the verdict states it ("" when it changed nothing)."""
        if not self.clipped:
            return ""
        return (f"{self.clipped} of {self.values.size} pairs clipped to the median "
                f"±{CLIP_SIGMAS:g} robust sd (±{math.expm1(self.bound):.1%}): "
                "blocks disturbed by outside load")


def robust_log_ratios(log_ratios: Sequence[float], *, sigmas: float = CLIP_SIGMAS,
                      min_pairs: int = CLIP_MIN_PAIRS) -> RobustPairs:
    """Winsorise paired log ratios at the median +- ``sigmas`` robust standard deviations.

    A block that another tenant slowed 4x gives one pair a log ratio of +-1.4 against a
    typical spread of +-0.05: averaged in, it moves an A/A's estimate by 4.6% at 30 pairs and
    widens its interval by far more. Clipping it to the edge of the ordinary spread keeps the
    pair (its sign still counts) but not its size. Under normal noise a 3-sd clip touches 0.3%
    of pairs and changes nothing measurable (the A/A simulations in tests/daemon/test_stats.py
    keep their false-positive rate). The spread is the median absolute deviation, which the
    disturbed pairs themselves barely move; below ``min_pairs`` nothing is clipped (too few to
    tell a disturbance from the spread)."""
    x = np.asarray(log_ratios, dtype=float)
    if x.size < 2:
        return RobustPairs(x, 0, math.nan, math.inf)
    med = float(np.median(x))
    noise = 1.4826 * float(np.median(np.abs(x - med)))
    if x.size < min_pairs or noise == 0:
        return RobustPairs(x, 0, noise, math.inf)
    bound = sigmas * noise
    clipped = np.clip(x, med - bound, med + bound)
    return RobustPairs(clipped, int(np.count_nonzero(clipped != x)), noise, bound)


def interval_of(seq: SequentialResult, log_ratios: Sequence[float], *,
                alpha: float = DEFAULT_ALPHA) -> Interval:
    """The always-valid confidence sequence at this look, as an Interval: what an interleaved
    verdict shows (valid whenever it is read, unlike a fixed-horizon t interval, which an
    A/A read after every block excludes 1 far more often than 5% of the time)."""
    x = np.asarray(log_ratios, dtype=float)
    ratio = math.exp(float(x.mean())) if x.size else math.nan
    return Interval(ratio, seq.low, seq.high, int(x.size), "confidence sequence", True,
                    1 - alpha, p_value=seq.p_value)


# --- sequential test -----------------------------------------------------------------------


def _log_bf(n: np.ndarray, sum_sq: np.ndarray, ss: np.ndarray, nmean_sq: np.ndarray,
            g: float) -> np.ndarray:
    """log BF_n of the scale-invariant normal-mixture test (formula in the module docstring)."""
    c = 1 + n * g
    den = ss + nmean_sq / c
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(sum_sq > 0, np.log(sum_sq) - np.log(den), 0.0)
    return -0.5 * np.log(c) + 0.5 * n * ratio


def sequential_test(log_ratios: Sequence[float], *, alpha: float = 0.05,
                    tau: float = DEFAULT_TAU) -> SequentialResult:
    """Always-valid test that the mean paired log ratio is 0, read after every pair.

    ``log_ratios[i] = log(arm_i / baseline_i)``. Stop as soon as ``stop`` is true; the
    false-positive rate stays below ``alpha`` however often one looks.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: must lie in (0, 1), got {alpha}")
    if tau <= 0:
        raise ValueError(f"tau: must be > 0, got {tau}")
    x = np.asarray(log_ratios, dtype=float)
    if x.ndim != 1 or not np.all(np.isfinite(x)):
        raise ValueError("log_ratios: must be a flat sequence of finite numbers")
    if x.size == 0:
        return SequentialResult(1.0, False, 0, None, 1.0, 0.0, math.inf)
    g = tau * tau
    # The test is scale-invariant, so it runs on x / max|x|: tiny ratios (an A/A of identical
    # figures differs in the last bits) would otherwise underflow when squared.
    scale = float(np.max(np.abs(x))) or 1.0
    k = np.arange(1, x.size + 1, dtype=float)
    z = x / scale
    csum, csq = np.cumsum(z), np.cumsum(z * z)
    nmean_sq = csum * csum / k
    ss = np.maximum(csq - nmean_sq, 0.0)
    log_bf = _log_bf(k, csq, ss, nmean_sq, g)
    p_path = np.minimum.accumulate(np.minimum(1.0, np.exp(-log_bf)))
    crossed = np.flatnonzero(log_bf >= math.log(1 / alpha))
    # Confidence sequence at look n: the means m whose BF (data shifted by m) stays < 1/alpha.
    # BF rises with w = n (xbar - m)^2 / SS; solve (1 + w)/(1 + w/c) = E for the boundary.
    n, c = float(x.size), 1 + x.size * g
    e = math.exp(2 * (math.log(1 / alpha) + 0.5 * math.log(c)) / n)
    mean = float(csum[-1]) / n * scale
    if e >= c:  # even an infinitely clear signal could not reject yet: no bound
        low, high = 0.0, math.inf
    else:
        half = math.sqrt((e - 1) / (1 - e / c) * float(ss[-1]) / n) * scale
        low, high = math.exp(mean - half), math.exp(mean + half)
    p = float(p_path[-1])
    return SequentialResult(
        p_value=p, stop=p <= alpha, n=x.size,
        stopped_at=int(crossed[0]) + 1 if crossed.size else None,
        bayes_factor=float(np.exp(log_bf[-1])), low=low, high=high)


def sequence_half_width(n: int, noise: float, *, alpha: float = 0.05,
                        tau: float = DEFAULT_TAU) -> float:
    """The half-width, on the log scale, of the always-valid confidence sequence after ``n``
    pairs whose log ratios have standard deviation ``noise`` (``inf`` while no bound exists):
    the formula :func:`sequential_test` inverts, at its expected spread."""
    if n < 2:
        return math.inf
    c = 1 + n * tau * tau
    e = math.exp(2 * (math.log(1 / alpha) + 0.5 * math.log(c)) / n)
    if e >= c:
        return math.inf
    return math.sqrt((e - 1) / (1 - e / c)) * noise


def reachable_band(noise: float, pairs: int, *, alpha: float = 0.05,
                   tau: float = DEFAULT_TAU, wander: float = BAND_WANDER) -> float | None:
    """The narrowest equivalence band (relative, rounded up to half a percent, at least 1%)
    that an A/A experiment of ``pairs`` pairs at per-pair noise ``noise`` reaches in most runs:
    the confidence sequence's half-width at ``pairs`` plus ``wander`` standard errors of the
    estimate (an A/A's ratio is not exactly 1, and the whole interval must fit). None below 2
    pairs, where the sequence has no bound. The inverse of :func:`pairs_to_equivalence`, less
    the wander."""
    if noise < 0 or pairs < 0:
        raise ValueError(f"noise and pairs must be >= 0 (got {noise}, {pairs})")
    half = sequence_half_width(pairs, noise, alpha=alpha, tau=tau)
    if not math.isfinite(half):
        return None
    band = math.expm1(half + wander * noise / math.sqrt(pairs))
    return max(0.01, math.ceil(band * 200 - 1e-9) / 200)


def pairs_to_equivalence(noise: float, band: float, *, alpha: float = 0.05,
                         tau: float = DEFAULT_TAU, limit: int = 100_000) -> int | None:
    """Pairs an A/A experiment needs, at per-pair noise ``noise`` (sd of the log ratios), before
    its confidence sequence fits inside ``+-band`` (relative) and "no difference" can be
    declared; None past ``limit``. What the forms say beside the equivalence band."""
    if noise < 0 or band <= 0:
        raise ValueError(f"noise must be >= 0 and band > 0 (got {noise}, {band})")
    target = math.log1p(band)
    lo, hi = 2, 2
    while sequence_half_width(hi, noise, alpha=alpha, tau=tau) > target:
        if hi >= limit:
            return None
        lo, hi = hi, min(limit, hi * 2)
    while lo < hi:  # the half-width falls with n: the first n inside the band
        mid = (lo + hi) // 2
        if sequence_half_width(mid, noise, alpha=alpha, tau=tau) > target:
            lo = mid + 1
        else:
            hi = mid
    return hi


# --- quality guard -------------------------------------------------------------------------


def _finite(xs: Sequence[float], name: str) -> np.ndarray:
    a = np.asarray(xs, dtype=float)
    if a.ndim != 1 or a.size < 2:
        raise ValueError(f"{name}: need at least 2 losses, got {a.size}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: losses must be finite")
    return a


def non_inferior(baseline_losses: Sequence[float], arm_losses: Sequence[float], *,
                 margin: float, confidence: float = 0.95, paired: bool) -> NonInferiority:
    """Is the arm's loss at most ``margin`` above the baseline's, at one-sided ``confidence``?"""
    _check_confidence(confidence)
    if not margin >= 0:
        raise ValueError(f"margin: must be >= 0, got {margin}")
    b, a = _finite(baseline_losses, "baseline_losses"), _finite(arm_losses, "arm_losses")
    if paired:
        if a.size != b.size:
            raise ValueError(f"paired: baseline has {b.size} losses, arm {a.size}")
        d = a - b
        n, diff = d.size, float(d.mean())
        se, df = float(d.std(ddof=1)) / math.sqrt(n), float(n - 1)
    else:
        n, diff = a.size + b.size, float(a.mean() - b.mean())
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se = math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se else 1.0
    half = float(student_t().ppf(confidence, df)) * se if se else 0.0
    return NonInferiority(diff, diff + half, diff + half < margin, margin, n, confidence,
                          lower=diff - half)


def trend_adjusted_gap(base: Sequence[tuple[float, float]], arm: Sequence[tuple[float, float]],
                       *, margin: float, at_end: bool = False, degree: int = 3,
                       confidence: float = 0.95) -> NonInferiority:
    """Non-inferiority of an arm's loss when both arms' losses fall as training goes on.

    ``base`` and ``arm``: ``(time, loss)`` per block (time: the block's position). One least
    squares fit shares a polynomial trend of ``degree`` in log(1 + time), the shape of a
    falling loss curve (power-law-like: steep, then flat), between the arms and gives the
    arm an offset (``at_end``: an offset and a slope of its own, read at the last time, so a
    gap that grows is what is tested). The one-sided upper bound of that gap, from the fit's
    residual variance (t with n - p degrees of freedom), must be under ``margin``.

    Why a fit, not pairs: in an interleaved run early in training the loss falls fast and
    curves, and a difference of neighbouring blocks is mostly the curve. The shared trend
    takes the curve out, and every block counts, not just complete pairs.
    """
    _check_confidence(confidence)
    if not margin >= 0:
        raise ValueError(f"margin: must be >= 0, got {margin}")
    pts = [(t, y, 0.0) for t, y in base] + [(t, y, 1.0) for t, y in arm]
    pts = [p for p in pts if math.isfinite(p[0]) and math.isfinite(p[1])]
    times = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    is_arm = np.array([p[2] for p in pts])
    u = np.log1p(times - times.min()) if times.size else times
    span = float(u.max()) if u.size else 0.0
    t = u / span if span > 0 else np.zeros_like(u)
    cols = [t**k for k in range(degree + 1)] + [is_arm] + ([is_arm * t] if at_end else [])
    x = np.column_stack(cols)
    n, p = x.shape
    if n - p < 1 or is_arm.sum() < 2 or (is_arm == 0).sum() < 2:
        raise ValueError(f"need more blocks than the fit's {p} terms (got {n})")
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    sigma2 = float(resid @ resid) / (n - p)
    cov = sigma2 * np.linalg.pinv(x.T @ x)
    c = np.zeros(p)
    c[degree + 1] = 1.0
    if at_end:
        c[degree + 2] = 1.0  # the arm's slope, at t = 1 (the last block)
    gap = float(c @ beta)
    half = float(student_t().ppf(confidence, n - p)) * math.sqrt(max(0.0, float(c @ cov @ c)))
    return NonInferiority(gap, gap + half, gap + half < margin, margin, n, confidence,
                          lower=gap - half)


# --- verdict -------------------------------------------------------------------------------


def _ci(iv: Interval) -> str:
    # CS: a confidence sequence, valid at every look; CI: an interval read once.
    kind = "CS" if iv.method == "confidence sequence" else "CI"
    return f"{iv.confidence:.0%} {kind} {iv.low:.3f}\u2013{iv.high:.3f}"


def _quality_text(q: NonInferiority | None) -> str:
    if q is None:
        return "loss not checked"
    if q.measure == "gradient error":
        return (f"{q.measure} {q.diff:.3g} exceeds {q.margin:g} (compressed gradients "
                "further from the true ones than sending nothing)" if math.isfinite(q.diff)
                else f"{q.measure} is not finite (NaN or Inf in compressed gradients)")
    if q.measure == "loss gap at the last block":
        return (f"{q.measure} {q.diff:+.4g} is past the margin {q.margin:.4g} nats and above 0 "
                f"at {q.confidence:.0%} (a gap that grows)")
    bounds = f"\u0394 {q.diff:+.4g}, {q.confidence:.0%} bounds {q.lower:+.4g}..{q.upper:+.4g}"
    if q.status == "non-inferior":
        return f"{q.measure} non-inferior ({bounds} < margin {q.margin:.4g} nats)"
    if q.status == "harm":
        return (f"{q.measure} worse by more than the margin ({bounds}: lower bound > "
                f"{q.margin:.4g} nats)")
    return (f"{q.measure} not shown non-inferior ({bounds} straddle the margin "
            f"{q.margin:.4g} nats)")


def verdict(*, speed: Interval | None, sequential: SequentialResult | None = None,
            quality: NonInferiority | None = None, budget_spent: bool = False,
            error: str | None = None, alpha: float = DEFAULT_ALPHA,
            equivalence: float = DEFAULT_EQUIVALENCE, min_effect: float = DEFAULT_MIN_EFFECT,
            quality_required: bool = False, note: str = "", arm: str = "B",
            baseline: str = "A") -> Verdict:
    """The experiment's outcome, by the rule in the module docstring, with the numbers behind it.

    ``sequential``: the always-valid test on the same pairs (None for unpaired trials, which
    are judged once, at the budget); ``speed`` is then read as valid at every look (the
    confidence sequence, :func:`interval_of`). ``quality``: None when no loss was compared;
    ``quality_required``: a faster arm is only ``better`` once its quality is shown (forked
    trials on their own weights), else ``not shown (budget spent)``. ``note``: a rule that
    changed the data (clipped pairs), said in the reason.
    """
    nan = math.nan
    if error is not None:
        r, lo, hi = (speed.ratio, speed.low, speed.high) if speed else (nan, nan, nan)
        p = sequential.p_value if sequential else speed.p_value if speed else None
        return Verdict("failed (error)", r, lo, hi, p, quality, f"failed: {error}",
                       speed.name if speed else "")
    if speed is None:
        raise ValueError("speed: an Interval is needed unless an error is reported")
    if equivalence < 0 or min_effect < 0:
        raise ValueError(f"equivalence and min_effect: must be >= 0, got {equivalence}, "
                         f"{min_effect}")
    # One test behind both figures: the sequential test's always-valid p beside its
    # confidence sequence, or the fixed-horizon test's p beside the interval it inverts (which
    # excludes 1 exactly when that p <= 1 - confidence).
    p = sequential.p_value if sequential else speed.p_value
    significant = (sequential.p_value <= alpha if sequential is not None
                   else speed.low > 1 or speed.high < 1)
    equivalent = 1 / (1 + equivalence) <= speed.low and speed.high <= 1 + equivalence
    futile = speed.high < 1 + min_effect
    # Futility ends a run early only for an arm that looks like no change. One whose estimate
    # is already min_effect below 1 is on its way to "worse", which says more and comes a pair
    # or two later: replayed on 12 real runs with a planted 5% slowdown (bench/ab_calibration),
    # stopping at futility said "no gain" in 7 of them at a median 260 steps, waiting said
    # "worse" in all 12 at 280. At the budget "no gain" still stands where it holds.
    stop_futile = futile and speed.ratio >= 1 / (1 + min_effect)
    harm = quality is not None and quality.status == "harm"
    decided = budget_spent or harm or (
        sequential is not None and (significant or equivalent or stop_futile))
    if not decided:
        raise ValueError("no verdict yet: the test has not stopped and the budget is not spent")

    r = speed.ratio
    looks = f"{speed.n} pairs" if speed.paired else f"{speed.n} trials"
    p_text = ("" if p is None else f", always-valid p {p:.2g}" if sequential is not None
              else f", p {p:.2g}")
    qtext = _quality_text(quality)
    tail = f"; {note}" if note else ""

    def out(kind: Kind, reason: str) -> Verdict:
        return Verdict(kind, r, speed.low, speed.high, p, quality, reason + tail, speed.name)

    if harm:
        return out("rejected (quality)", f"{arm} rejected: {qtext}; speed {r:.3f}x "
                   f"({_ci(speed)})")
    if significant and r < 1:
        return out("worse", f"{arm} is {(1 - r):.1%} slower than {baseline} (ratio {r:.3f}, "
                   f"{_ci(speed)}{p_text}, {looks}), {qtext}")
    if significant:
        if quality_required and (quality is None or quality.status != "non-inferior"):
            return out("not shown (budget spent)",
                       f"{arm} is {r:.3f}x faster ({_ci(speed)}{p_text}, {looks}) but its "
                       f"quality is not shown yet: {qtext}; a longer run would tell")
        return out("better", f"{arm} is {r:.3f}x faster than {baseline} ({_ci(speed)}"
                   f"{p_text}, {looks}), {qtext}")
    if equivalent:
        return out("no difference", f"{arm} and {baseline} within \u00b1{equivalence:.0%} "
                   f"(ratio {r:.3f}, {_ci(speed)}{p_text}, {looks}), {qtext}")
    if futile:
        return out("no gain", f"{arm} cannot be {min_effect:.0%} faster than {baseline} "
                   f"(ratio {r:.3f}, {_ci(speed)}{p_text}, {looks}): not worth a change, "
                   f"{qtext}")
    return out("inconclusive (budget spent)",
               f"budget spent after {looks}: ratio {r:.3f} ({_ci(speed)}{p_text}); neither a "
               f"difference, equivalence within \u00b1{equivalence:.0%} nor futility against "
               f"{min_effect:.0%} shown, {qtext}")


# --- simulation ----------------------------------------------------------------------------


def simulate_blocks(n_blocks: int, *, speedup: float = 1.0, cv: float = 0.05,
                    drift: float = 0.10, drift_period: float = 30.0, hiccup: float = 0.02,
                    level: float = 1000.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Paired block throughputs (baseline, arm) as this noisy shared 2-core machine makes them.

    Blocks run in ABBA order (pair i is A then B when i is even, B then A when odd), two time
    slots per pair. Each block's throughput is ``level * speed(t) * noise``, arm blocks times
    ``speedup``, where
    - ``cv``: independent lognormal noise per block (coefficient of variation);
    - ``drift``: the machine's slow wander: a sinusoid of this relative amplitude, period
      ``drift_period`` pairs, random phase, plus a random walk with steps of ``drift / 10``;
      adjacent blocks share it, so pairing cancels nearly all of it;
    - ``hiccup``: probability that a block is hit by another tenant and loses 10-40% of its speed.
    Defaults: measured here by running the real trainer (1 thread) in repeated A/A blocks of 30
    steps (~3.5 s): adjacent-block noise ~5% per block in calm periods (robust ~5%, plain sd
    5.8%), speed wandering by ~+-10% over minutes, and dips of 10-60% while other sessions'
    tests ran (a few % of blocks when calm, far more during contention).
    """
    if n_blocks < 0:
        raise ValueError(f"n_blocks: must be >= 0, got {n_blocks}")
    rng = np.random.default_rng(seed)
    slots = 2 * n_blocks
    t = np.arange(slots) / 2.0  # in pairs
    phase = rng.uniform(0, 2 * np.pi)
    walk = np.cumsum(rng.normal(0, drift / 10, slots))
    log_speed = drift * np.sin(2 * np.pi * t / drift_period + phase) + walk
    sigma = math.sqrt(math.log1p(cv * cv))
    noise = rng.normal(-sigma * sigma / 2, sigma, slots)
    hit = rng.random(slots) < hiccup
    noise += np.where(hit, np.log1p(-rng.uniform(0.1, 0.4, slots)), 0.0)
    tput = level * np.exp(log_speed + noise)
    first = np.arange(0, slots, 2)
    a_first = (np.arange(n_blocks) % 2) == 0  # ABBA: A B | B A | A B ...
    base = np.where(a_first, tput[first], tput[first + 1])
    armv = np.where(a_first, tput[first + 1], tput[first]) * speedup
    return base, armv
