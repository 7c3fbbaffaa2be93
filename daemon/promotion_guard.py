"""The rule that keeps or rolls back a promoted setting: pure, plain samples in, an action and
its reason out (``daemon/promotions.py``'s ``Guard`` feeds it a run's rank-0 reports).

Throughput, with the project's own statistics (``daemon/experiments/stats.py``): the timed
step reports are grouped into blocks of ``block`` steps, a block's figure the median of its
per-step rates (one checkpoint or a neighbour's burst in a block does not move it). The
reference is the ``ref_blocks`` blocks just before the change; each block after the change
(the first ``settle`` steps left out: the switch itself) gives a log ratio against the
reference's mean log figure, and the always-valid test (``sequential_test``) gives a
confidence sequence for the ratio that may be read after every block. The reference is
itself an estimate, so its own t interval is added to the sequence's bounds, each at half of
``alpha`` (a union bound: both hold together with probability ``1 - alpha``). Then:
- the whole interval below ``1 - slowdown``: shown slower by more than ``slowdown``, rolled
  back;
- its lower bound at or above ``1 - min_effect``: shown not slower by more than the smallest
  effect worth having, kept;
- ``max_blocks`` blocks watched with neither: no evidence of harm, kept.

Both margins are 2% by default, and the watch is short (15 blocks), because a comparison of
before with after (the change cannot be interleaved) cannot tell a smaller slowdown from the
machine's own drift. Simulated with this machine's drift (speed wandering by +-10% over
~1800 steps, 5% noise per step; the harness is in ``tests/daemon/test_promotion_guard.py``),
200 watches each: no slowdown margin and 30 blocks rolled back 41% of A/A promotions; these
defaults roll back 2 of 200 (0 of 200 at +-5%) and catch 192 of 200 10% slowdowns (200 at
+-5%), a median 90 steps after the change.

Validation loss (EvalEvents): the trend of the last ``trend_evals`` evaluations before the
change, a line in log(step) (flat at the last one with fewer than 3), is what the loss would
have been; ``harm_evals`` consecutive evaluations after the change above it by more than
``loss_margin`` (absolute nats) roll back. A keep waits for ``harm_evals`` evaluations after
the change when there were some before it (up to ``max_blocks``).

At once, whatever the blocks say: a non-finite training or validation loss, and a divergence:
the median training loss of the last ``diverge_window`` steps above ``diverge_ratio`` times
the median before the change. One noisy training step is never a verdict.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from traind.daemon.experiments.stats import sequential_test, student_t

if TYPE_CHECKING:
    from collections.abc import Sequence

Action = Literal["wait", "keep", "rollback"]


@dataclass(frozen=True, slots=True)
class Sample:
    step: int
    loss: float
    tokens_per_second: float  # the job's, over the interval the report closes (0: untimed)


@dataclass(frozen=True, slots=True)
class EvalSample:
    step: int
    loss: float  # validation loss


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """The rule's settings (module docstring). ``slowdown``: the shown ratio below
    ``1 - slowdown`` rolls back (a negative value forces a rollback in tests)."""

    block: int = 10
    ref_blocks: int = 10
    settle: int = 2
    max_blocks: int = 15
    min_effect: float = 0.02
    slowdown: float = 0.02
    alpha: float = 0.05
    diverge_ratio: float = 1.5
    diverge_window: int = 10
    loss_margin: float = 0.05
    harm_evals: int = 2
    trend_evals: int = 5

    def __post_init__(self) -> None:
        for name in ("block", "ref_blocks", "max_blocks", "diverge_window", "harm_evals",
                     "trend_evals"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha: must lie in (0, 1), got {self.alpha}")
        if self.settle < 0 or self.loss_margin < 0 or not 0 <= self.min_effect < 1:
            raise ValueError("settle and loss_margin must be >= 0, min_effect in [0, 1)")

    @property
    def before(self) -> int:
        """Step reports kept from before a change: the throughput reference."""
        return self.block * self.ref_blocks

    @property
    def after(self) -> int:
        """Step reports after a change at which the watch ends at the latest."""
        return self.settle + self.block * self.max_blocks


@dataclass(frozen=True, slots=True)
class SpeedCheck:
    action: Action
    ratio: float  # after / before; nan without a reference or a block
    low: float
    high: float
    blocks: int  # after the change
    reason: str


def _blocks(rates: Sequence[float], size: int, *, from_end: bool) -> list[float]:
    """The median of each full block of ``size`` rates, aligned to the end of ``rates``
    (``from_end``: the blocks nearest the change) or to its start."""
    n = len(rates) // size * size
    kept = rates[len(rates) - n:] if from_end else rates[:n]
    return [statistics.median(kept[i:i + size]) for i in range(0, n, size)]


def _timed(samples: Sequence[Sample]) -> list[float]:
    return [s.tokens_per_second for s in samples
            if s.tokens_per_second > 0 and math.isfinite(s.tokens_per_second)]


def speed_check(before: Sequence[Sample], after: Sequence[Sample],
                policy: GuardPolicy = GuardPolicy()) -> SpeedCheck:
    """Throughput after the change against before it (module docstring); ``wait`` until
    the test decides or ``max_blocks`` pass."""
    p, nan = policy, math.nan
    ref = [math.log(b) for b in _blocks(_timed(before), p.block, from_end=True)]
    done = len(after) >= p.after
    if len(ref) < 2:
        why = (f"no throughput reference ({len(ref)} block of {p.block} timed steps "
               "before the change)")
        return SpeedCheck("keep" if done else "wait", nan, nan, nan, 0, why)
    level = statistics.fmean(ref)
    blocks = _blocks(_timed(after[p.settle:]), p.block, from_end=False)
    x = [math.log(b) - level for b in blocks]
    seq = sequential_test(x, alpha=p.alpha / 2)
    # The reference's own (1 - alpha/2) t interval widens the sequence on both sides.
    h = float(student_t().ppf(1 - p.alpha / 4, len(ref) - 1)) * statistics.stdev(ref) \
        / math.sqrt(len(ref))
    ratio = math.exp(statistics.fmean(x)) if x else nan
    low = seq.low * math.exp(-h)
    high = seq.high * math.exp(h) if math.isfinite(seq.high) else math.inf
    shown = (f"throughput {ratio:.3f}x the {len(ref)} blocks before (always-valid "
             f"{1 - p.alpha:.0%} interval {low:.3f}\u2013{high:.3g}, {len(x)} blocks of "
             f"{p.block} steps)") if x else "no full block after the change"
    if high < 1 - p.slowdown:
        rule = f"below {1 - p.slowdown:g}"
        return SpeedCheck("rollback", ratio, low, high, len(x),
                          f"slowdown: {shown}, shown slower (the whole interval lies "
                          f"{rule})")
    if low >= 1 - p.min_effect:
        return SpeedCheck("keep", ratio, low, high, len(x),
                          f"{shown}: shown not slower by more than {p.min_effect:.0%}")
    if done:
        return SpeedCheck("keep", ratio, low, high, len(x),
                          f"{shown}: no evidence of a slowdown in {p.max_blocks} blocks")
    return SpeedCheck("wait", ratio, low, high, len(x), shown)


def _trend(evals: Sequence[EvalSample]) -> tuple[float, float]:
    """(a, b) of loss = a + b log(step) through the evaluations (b = 0 with fewer than 3)."""
    if len(evals) < 3:
        return evals[-1].loss, 0.0
    u = [math.log(max(e.step, 1)) for e in evals]
    y = [e.loss for e in evals]
    mu, my = statistics.fmean(u), statistics.fmean(y)
    suu = sum((a - mu) ** 2 for a in u)
    b = sum((a - mu) * (c - my) for a, c in zip(u, y, strict=True)) / suu if suu else 0.0
    return my - b * mu, b


def val_check(evals_before: Sequence[EvalSample], evals_after: Sequence[EvalSample],
              policy: GuardPolicy = GuardPolicy()) -> tuple[Action, str]:
    """``rollback`` on evidence of harm, ``keep`` once enough evaluations after the change
    show none (or there is nothing before it to compare with), else ``wait``."""
    p = policy
    ref = [e for e in evals_before if math.isfinite(e.loss)][-p.trend_evals:]
    if not ref:
        return "keep", "no validation loss before the change to compare with"
    a, b = _trend(ref)
    last = list(evals_after)[-p.harm_evals:]
    expected = [a + b * math.log(max(e.step, 1)) for e in last]
    what = ("the pre-change trend" if len(ref) >= 3 else
            f"the last validation loss before the change ({ref[-1].loss:.4g})")
    if len(last) == p.harm_evals and all(
            e.loss > x + p.loss_margin for e, x in zip(last, expected, strict=True)):
        seen = ", ".join(f"{e.loss:.4g} at step {e.step} against {x:.4g}"
                         for e, x in zip(last, expected, strict=True))
        return "rollback", (f"validation loss above {what} by more than {p.loss_margin:g} on "
                            f"{p.harm_evals} consecutive evaluations ({seen})")
    if len(evals_after) < p.harm_evals:
        return "wait", f"{len(evals_after)} of {p.harm_evals} validation losses after the change"
    return "keep", (f"validation loss within {p.loss_margin:g} of {what} "
                    f"(last {last[-1].loss:.4g} at step {last[-1].step})")


def judge(before: Sequence[Sample], after: Sequence[Sample],
          policy: GuardPolicy = GuardPolicy(), *, evals_before: Sequence[EvalSample] = (),
          evals_after: Sequence[EvalSample] = ()) -> tuple[Action, str]:
    """Keep, roll back or wait for more, with the rule and the numbers in words."""
    p = policy
    for s in after:
        if not math.isfinite(s.loss):
            return "rollback", f"non-finite loss ({s.loss}) at step {s.step}"
    for e in evals_after:
        if not math.isfinite(e.loss):
            return "rollback", f"non-finite validation loss ({e.loss}) at step {e.step}"
    losses = [s.loss for s in before if math.isfinite(s.loss)]
    window = [s.loss for s in after[-p.diverge_window:]]
    if losses and len(window) == p.diverge_window:
        ref, now = statistics.median(losses), statistics.median(window)
        if ref > 0 and now > p.diverge_ratio * ref:
            return "rollback", (
                f"training loss diverged: median {now:.4g} over the last {p.diverge_window} "
                f"steps (to step {after[-1].step}) against {ref:.4g} before the change "
                f"(rule: a median above {p.diverge_ratio:g}x, never one step)")
    val_action, val_reason = val_check(evals_before, evals_after, p)
    if val_action == "rollback":
        return "rollback", val_reason
    speed = speed_check(before, after, p)
    if speed.action == "rollback":
        return "rollback", speed.reason
    done = len(after) >= p.after
    if speed.action == "keep" and (val_action == "keep" or done):
        return "keep", (f"{speed.reason}; {val_reason}; no NaN, no sustained divergence "
                        f"in {len(after)} steps")
    return "wait", f"{speed.reason}; {val_reason}"
