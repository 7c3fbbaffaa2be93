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
from collections.abc import Mapping
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


def measured_pairs(blocks: Sequence[Block], arms: Sequence[str], arm: str
                   ) -> list[tuple[Block, Block]]:
    """The pairs a verdict reads: those whose two blocks were both timed."""
    return [(a, b) for a, b in pairs(blocks, arms, arm) if a.throughput > 0 and b.throughput > 0]


# A verdict record's flag: its run stopped with its daemon (preempted by a SIGTERM, or left
# stranded by a kill) before the arm was decided. Nothing was shown: an auto-tune round that
# ends so is run again (daemon/autotune/runner.py), never read as the challenger failing, and
# the pairs it measured carry into the next (daemon/experiments/reuse.py).
INTERRUPTED = "interrupted"


def interrupted(verdict: Mapping[str, Any] | None) -> bool:
    """Whether an arm of ``verdict`` was left undecided because its daemon stopped."""
    return any(isinstance(r, Mapping) and r.get(INTERRUPTED) for r in (verdict or {}).values())


def own_pairs(record: Mapping[str, Any]) -> int:
    """The pairs an arm's verdict record counted of its own run: ``pairs`` less those it
    ``carried`` from earlier experiments (``evaluate``'s fields)."""
    return int(record.get("pairs") or 0) - int(record.get("carried") or 0)


def log_ratios(ps: Sequence[tuple[Block, Block]]) -> list[float]:
    """Each pair's log(arm / baseline) throughput: what the sequential test reads."""
    return [math.log(b.throughput / a.throughput) for a, b in ps]


def evaluate(blocks: Sequence[Block], arms: Sequence[str], *, finished: bool,
             loss_margin: float, alpha: float = stats.DEFAULT_ALPHA,
             min_effect: float = stats.DEFAULT_MIN_EFFECT,
             equivalence: float = stats.DEFAULT_EQUIVALENCE,
             prior: Mapping[str, Sequence[float]] | None = None) -> dict[str, dict[str, Any]]:
    """Per non-baseline arm: the verdict so far (``running`` until the arm is decided, see
    ``stats.DECIDED``, or the run ends), with the numbers behind it.

    The pairs' log ratios are clipped where a block was disturbed
    (:func:`stats.robust_log_ratios`), the always-valid test reads them after every pair, and
    the interval shown is its confidence sequence, valid whenever it is read. The quality
    check here is an early alarm on shared weights (:func:`guard`): it can reject on evidence
    of harm, never pass an arm's effect on the model (forked trials judge that).

    ``prior``: per arm, the log ratios of pairs against the same baseline from earlier runs of
    the same comparison (``ExperimentSpec.carry``: the auto-tuner's later speed rounds of a
    stage), read before this run's as one stream. The always-valid test may be continued so:
    its error bound holds at every look, so going on after an undecided look, in this run or
    a later one, is one more look. ``pairs`` counts them all, ``carried`` the earlier ones;
    the quality alarm reads this run's blocks only (an earlier run's loss is another model's
    at another step)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms[1:]:
        ps = measured_pairs(blocks, arms, arm)
        carried = list((prior or {}).get(arm, ()))
        logs = carried + log_ratios(ps)
        n = len(logs)
        if n < 2:
            if finished:  # a budget below two rounds: say so, never "done" and "running"
                out[arm] = {"kind": "inconclusive (budget spent)", "pairs": n,
                            "carried": len(carried),
                            "ratio": None, "low": None, "high": None, "p_value": None,
                            "quality": None, "reason": f"budget spent after {n} paired "
                            "blocks; a verdict needs at least 2 (a longer budget)"}
            else:
                out[arm] = {"kind": "running", "pairs": n, "carried": len(carried),
                            "reason": f"{n} paired blocks so far; 2 needed"}
            continue
        rob = stats.robust_log_ratios(logs)
        seq = stats.sequential_test(rob.values.tolist(), alpha=alpha)
        speed = stats.interval_of(seq, rob.values.tolist(), alpha=alpha)
        quality = guard([(b.block, b.loss) for b in blocks if b.arm == arms[0]],
                        [(b.block, b.loss) for b in blocks if b.arm == arm],
                        [b.grad_error for _, b in ps], margin=loss_margin,
                        first_block=len(arms), early=not finished)
        extra = {"noise": _num(rob.noise), "clipped": rob.clipped, "interval": speed.name,
                 "grad_error": _num(_mean([b.grad_error for _, b in ps])),
                 "carried": len(carried)}
        of = f"{n} pairs, {len(carried)} carried" if carried else f"{n} pairs"
        try:
            v = stats.verdict(speed=speed, sequential=seq, quality=quality,
                              budget_spent=finished, alpha=alpha, equivalence=equivalence,
                              min_effect=min_effect, note=rob.rule, arm=arm,
                              baseline=arms[0])
        except ValueError:  # not decided yet
            out[arm] = {"kind": "running", "pairs": n, "ratio": speed.ratio,
                        "low": _num(speed.low), "high": _num(speed.high),
                        "p_value": seq.p_value, **extra,
                        "reason": f"{arm}: {speed.ratio:.3f}x so far ({of}, "
                                  f"always-valid p {seq.p_value:.2g})"}
            continue
        out[arm] = {**verdict_record(v, pairs=n), **extra}
    return out


# Blocks of each arm before the growing-gap rule may reject. Replayed on 20 real A/A runs
# (bench/ab_calibration.py, 24 blocks each), the rule at "estimate past the margin, lower
# bound above 0" rejected 2 equal arms, one after 7 blocks (the slope of 7 noisy points).
MIN_TREND_BLOCKS = 10


def guard(base: Sequence[tuple[float, float]], arm: Sequence[tuple[float, float]],
          grad_errors: Sequence[float], *, margin: float, first_block: int = 0,
          early: bool = False) -> stats.NonInferiority | None:
    """The interleaved quality alarm over ``(block, loss)`` of each arm (None: too few blocks
    to fit). Both arms train one shared model, so harm one does spreads into the other's
    blocks: this can show harm, never the absence of it (forked trials do that).

    - Gradient fidelity: compressed gradients must stay finite and closer to the true ones
      than sending nothing would be (relative error at most 1). Error-feedback methods
      (topk, powersgd) run at high per-step error by design and repay it later, so a tighter
      bound would reject methods that train well: the loss decides those.
    - Loss level: the arm's loss against the baseline's within ``margin`` (nats, one-sided
      ``confidence``), after a trend shared by both arms is taken out
      (:func:`stats.trend_adjusted_gap`); harm when its lower bound is above the margin.
      Blocks before ``first_block`` (the first round) are left out: the loss falls steepest
      there and the baseline always runs first, which favoured every challenger by ~0.02 nats.
    - Loss trend: the gap at the last block when the arm may also have a slope of its own, so
      an arm whose gap grows (error that accumulates) is caught even if the early blocks hide
      it in the mean; harm when its lower bound is above the margin, after
      ``MIN_TREND_BLOCKS`` blocks of each arm.
    The check that shows harm is returned, else the level check.

    ``early``: read while the run goes on, after every block. Peeking so often at a bound
    would reject equal arms, so the bounds are then 99%. Replayed on real runs of equal
    quality here (bench/ab_calibration.py): with a 95% bound and an extrapolated gap above 0,
    2 of 2 were rejected by block 18; with 99% early and the gap's bound above 0 at the end, 2
    of 20 (one after 7 blocks); with the rule now, 0 of 20 (and 0 of the 10 planted-slowdown
    runs, whose quality is equal too).
    """
    confidence = 0.99 if early else 0.95
    bad = [e for e in grad_errors if not math.isfinite(e) or e > 1.0]
    if bad:
        return stats.NonInferiority(diff=bad[0], upper=bad[0], non_inferior=False, margin=1.0,
                                    n=len(grad_errors), measure="gradient error",
                                    shown_harm=True)
    base = [(t, y) for t, y in base if math.isfinite(y) and t >= first_block]
    arm = [(t, y) for t, y in arm if math.isfinite(y) and t >= first_block]
    try:
        level = stats.trend_adjusted_gap(base, arm, margin=margin, confidence=confidence)
    except ValueError:
        return None  # too few blocks yet
    level = dataclasses.replace(level, measure="loss (shared weights)")
    if level.status == "harm":
        return level
    if min(len(base), len(arm)) < MIN_TREND_BLOCKS:
        return level
    with contextlib.suppress(ValueError):
        end = stats.trend_adjusted_gap(base, arm, margin=margin, at_end=True,
                                       confidence=confidence)
        # The gap at the end extrapolates a slope: too wide to demand non-inferiority of
        # (it would reject most equal arms), so it rejects only on evidence of harm: its
        # lower bound above the margin, on enough blocks for a slope.
        if end.lower > margin:
            return dataclasses.replace(end, non_inferior=False, shown_harm=True,
                                       measure="loss gap at the last block")
    return level


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def verdict_record(v: stats.Verdict, *, pairs: int, suffix: str = "") -> dict[str, Any]:
    """A verdict as stored in JSON (summaries, experiment rows): no NaN, which JSON lacks."""
    return {"kind": v.kind, "pairs": pairs, "ratio": _num(v.ratio), "low": _num(v.low),
            "high": _num(v.high), "p_value": v.p_value, "interval": v.interval,
            "reason": v.reason + suffix, "quality": quality_record(v.quality)}


def quality_record(q: stats.NonInferiority | None) -> dict[str, Any] | None:
    """A quality check as stored in JSON, with its three-way ``status``; infinite bounds (an
    unbounded side) become null, which JSON (and PostgreSQL's json) can hold."""
    if q is None:
        return None
    return {k: _num(v) if isinstance(v, float) else v for k, v in asdict(q).items()} | {
        "status": q.status}


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
