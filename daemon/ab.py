"""The verdict of an interleaved A/B run, from its blocks (pure: plain records in, dicts out).

Blocks come in rounds, every arm once per round (A B | B A | ...), so each non-baseline arm
pairs with the baseline inside each round: the pair's log throughput ratio is what the
always-valid sequential test and the paired interval in ``daemon/stats.py`` read. Drift of the
machine between rounds cancels in the ratio; within a round the order alternates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from traind.daemon import stats


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
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


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
        losses = [(a.loss, b.loss) for a, b in ps if math.isfinite(a.loss + b.loss)]
        quality = guard(losses, [b.grad_error for _, b in ps], margin=loss_margin)
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


def guard(losses: Sequence[tuple[float, float]], grad_errors: Sequence[float], *,
          margin: float) -> stats.NonInferiority | None:
    """The interleaved quality guard (None: fewer than 2 comparable pairs).

    - Gradient fidelity: compressed gradients must stay finite and closer to the true ones
      than sending nothing would be (relative error at most 1). Error-feedback methods
      (topk, powersgd) run at high per-step error by design and repay it later, so a tighter
      bound would reject methods that train well: the loss decides those.
    - Loss level: the arm's loss is non-inferior to the baseline's within ``margin``
      (one-sided 95%), paired by ABBA unit (:func:`abba_units`).
    - Loss trend: the same test on the later half of the units, when there are 4 or more, so
      an arm whose gap grows (error that accumulates) is caught even if the early blocks hide
      it in the mean.
    The first failing check is returned, else the tightest passing one.
    """
    bad = [e for e in grad_errors if not math.isfinite(e) or e > 1.0]
    if bad:
        return stats.NonInferiority(diff=bad[0], upper=bad[0], non_inferior=False, margin=1.0,
                                    n=len(grad_errors), measure="gradient error")
    units = abba_units(losses)
    if len(units) < 2:
        return None
    checks = [stats.non_inferior([a for a, _ in units], [b for _, b in units],
                                 margin=margin, paired=True)]
    late = units[len(units) // 2:]
    if len(units) >= 4 and len(late) >= 2:
        checks.append(stats.non_inferior([a for a, _ in late], [b for _, b in late],
                                         margin=margin, paired=True))
    failing = [q for q in checks if not q.non_inferior]
    return failing[0] if failing else max(checks, key=lambda q: q.upper)


def abba_units(pairs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Consecutive rounds merged into A B B A units, ``(mean A, mean B)`` each.

    The loss falls as training goes on, so within a round the arm that runs second looks
    better. Rounds alternate the order, and in a unit of two rounds a linear trend adds the
    same to both arms' means: it cancels in their difference, where paired rounds alone would
    leave it as noise (and on a short run it is most of the noise). A last odd round is left
    out. Fewer than 4 rounds: the rounds as they are."""
    if len(pairs) < 4:
        return list(pairs)
    return [((a0 + a1) / 2, (b0 + b1) / 2)
            for (a0, b0), (a1, b1) in zip(pairs[0::2], pairs[1::2], strict=False)]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def verdict_record(v: stats.Verdict, *, pairs: int, suffix: str = "") -> dict[str, Any]:
    """A verdict as stored in JSON (summaries, experiment rows): no NaN, which JSON lacks."""
    return {"kind": v.kind, "pairs": pairs, "ratio": _num(v.ratio), "low": _num(v.low),
            "high": _num(v.high), "p_value": v.p_value, "reason": v.reason + suffix,
            "quality": asdict(v.quality) if v.quality else None}


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
