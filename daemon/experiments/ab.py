"""The verdict of an interleaved A/B run, from its blocks (pure: plain records in, dicts out).

Blocks come in rounds, every arm once per round (A B | B A | ...), so each non-baseline arm
pairs with the baseline inside each round: the pair's log throughput ratio is what the
always-valid sequential test and the paired interval in ``daemon/experiments/stats.py`` read.
Drift of the machine between rounds cancels in the ratio; within a round the order alternates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from traind.daemon.experiments import stats
from traind.metrics import throughput

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True, slots=True)
class Block:
    arm: str
    block: int
    tokens: int
    seconds: float
    loss: float
    grad_error: float = 0.0  # the block's relative compression error (nan: non-finite)

    @property
    def throughput(self) -> float:
        """One rank's tokens/s over the block's measured steps (NaN: none timed): the one
        definition (metrics/throughput.py) over the block's window. It is one rank's, not the
        job's: the verdict reads only ratios between arms of one job, which the world size
        would not change."""
        return throughput.rate(self.tokens, self.seconds)


def pairs(blocks: Sequence[Block], arms: Sequence[str], arm: str) -> list[tuple[Block, Block]]:
    """(baseline, arm) blocks of each complete round."""
    n = len(arms)
    by_round: dict[int, dict[str, Block]] = {}
    for b in blocks:
        by_round.setdefault(b.block // n, {})[b.arm] = b
    return [(r[arms[0]], r[arm]) for _, r in sorted(by_round.items())
            if arms[0] in r and arm in r]


def evaluate(blocks: Sequence[Block], arms: Sequence[str], *, finished: bool,
             loss_margin: float, alpha: float = 0.05) -> dict[str, dict[str, Any]]:
    """Per non-baseline arm: the verdict so far (``running`` until the sequential test stops
    or the run ends), with the numbers behind it."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms[1:]:
        ps = [(a, b) for a, b in pairs(blocks, arms, arm)
              if a.throughput > 0 and b.throughput > 0]
        if len(ps) < 2:
            out[arm] = {"kind": "running", "pairs": len(ps),
                        "reason": f"{len(ps)} paired blocks so far; 2 needed"}
            continue
        base_tps = [a.throughput for a, _ in ps]
        arm_tps = [b.throughput for _, b in ps]
        speed = stats.speedup(base_tps, arm_tps, paired=True)
        seq = stats.sequential_test([math.log(b / a) for a, b in zip(base_tps, arm_tps,
                                                                     strict=True)],
                                    alpha=alpha)
        quality = guard([(b.block, b.loss) for b in blocks if b.arm == arms[0]],
                        [(b.block, b.loss) for b in blocks if b.arm == arm],
                        [b.grad_error for _, b in ps], margin=loss_margin)
        if not (seq.stop or finished):
            out[arm] = {"kind": "running", "pairs": len(ps), "ratio": speed.ratio,
                        "low": speed.low, "high": speed.high, "p_value": seq.p_value,
                        "reason": f"{arm}: {speed.ratio:.3f}x so far ({len(ps)} pairs, "
                                  f"always-valid p {seq.p_value:.2g})"}
            continue
        v = stats.verdict(speed=speed, sequential=seq, quality=quality, budget_spent=finished,
                          alpha=alpha, arm=arm, baseline=arms[0])
        out[arm] = {**verdict_record(v, pairs=len(ps)),
                    "grad_error": _num(_mean([b.grad_error for _, b in ps]))}
    return out


def guard(base: Sequence[tuple[float, float]], arm: Sequence[tuple[float, float]],
          grad_errors: Sequence[float], *, margin: float) -> stats.NonInferiority | None:
    """The interleaved quality guard over ``(block, loss)`` of each arm (None: too few blocks
    to fit).

    - Gradient fidelity: compressed gradients must stay finite and closer to the true ones
      than sending nothing would be (relative error at most 1). Error-feedback methods
      (topk, powersgd) run at high per-step error by design and repay it later, so a tighter
      bound would reject methods that train well: the loss decides those.
    - Loss level: the arm's loss is non-inferior to the baseline's within ``margin`` (one-sided
      95%), after a trend shared by both arms is taken out (:func:`stats.trend_adjusted_gap`).
    - Loss trend: the gap at the last block when the arm may also have a slope of its own, so
      an arm whose gap grows (error that accumulates) is caught even if the early blocks hide
      it in the mean; rejected on evidence of harm (see below), not on lack of proof.
    The failing check is returned, else the level check.
    """
    bad = [e for e in grad_errors if not math.isfinite(e) or e > 1.0]
    if bad:
        return stats.NonInferiority(diff=bad[0], upper=bad[0], non_inferior=False, margin=1.0,
                                    n=len(grad_errors), measure="gradient error")
    base = [(t, y) for t, y in base if math.isfinite(y)]
    arm = [(t, y) for t, y in arm if math.isfinite(y)]
    try:
        level = stats.trend_adjusted_gap(base, arm, margin=margin)
    except ValueError:
        return None  # too few blocks yet
    if not level.non_inferior:
        return level
    with contextlib.suppress(ValueError):
        end = stats.trend_adjusted_gap(base, arm, margin=margin, at_end=True)
        # The gap at the end extrapolates a slope: too wide to demand non-inferiority of
        # (it would reject most equal arms), so it rejects only on evidence of harm: an
        # estimate past the margin whose lower bound is above zero.
        if end.diff > margin and 2 * end.diff - end.upper > 0:
            return dataclasses.replace(end, non_inferior=False,
                                       measure="loss gap at the last block")
    return level


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def verdict_record(v: stats.Verdict, *, pairs: int, suffix: str = "") -> dict[str, Any]:
    """A verdict as stored in JSON (summaries, experiment rows): no NaN, which JSON lacks."""
    return {"kind": v.kind, "pairs": pairs, "ratio": _num(v.ratio), "low": _num(v.low),
            "high": _num(v.high), "p_value": v.p_value, "reason": v.reason + suffix,
            "quality": asdict(v.quality) if v.quality else None}


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
