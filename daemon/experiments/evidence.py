"""What an experiment's verdict rests on, summarised for its page (pure: plain records in).

An interleaved experiment's evidence is its run's blocks (one ``arm`` run-event each, the
ArmEvent's throughput and mean loss); a forked one's, its trials (final tokens/s and
validation loss). From them: each arm's mean figures, shown as columns beside the verdict,
and how far the experiment has got against its budget, shown while it runs.

Throughput is averaged geometrically, as the verdict's ratio is (``stats.speedup``: the ratio of
geometric means), so the two columns divide to the ratio shown beside them (exactly for a
complete set of pairs). Losses are plain means.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from traind.contracts.states import TRIAL_ENDED
from traind.daemon.experiments.ab import Block, own_pairs
from traind.daemon.experiments.bands import budget_pairs
from traind.daemon.service import ArmMean, ExperimentEvidence, Measurement, Progress

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence


def _arm_rows(rows: Iterable[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The ``arm`` run-event rows (``daemon/ingest/messages.py``) that name an arm and a
    block, each with its ``data``, in the order stored."""
    for r in rows:
        data = r.get("data") or {}
        if isinstance(data.get("arm"), str) and isinstance(data.get("block"), int):
            yield r, data


def blocks_of(rows: Iterable[dict[str, Any]]) -> list[Measurement]:
    """An interleaved run's ``arm`` run-events as measurements, in block order. A block
    recorded twice (the run resumed from a checkpoint before it and ran it again) counts once,
    with its newest figures, as the verdict counted it."""
    by_block: dict[tuple[str, int], Measurement] = {}
    for r, data in _arm_rows(rows):
        by_block[(data["arm"], data["block"])] = Measurement(
            arm=data["arm"], index=data["block"], step=r.get("step"),
            tokens_per_second=_pos(r.get("value")), loss=_finite(data.get("loss")))
    return sorted(by_block.values(), key=lambda m: m.index)


def verdict_blocks(rows: Iterable[dict[str, Any]]) -> list[Block]:
    """The same rows as the verdict's blocks (``ab.Block``), in the order stored (``ab.pairs``
    keeps a block recorded twice once, its newest): an ended run's evidence judged again."""
    return [Block(data["arm"], data["block"], int(_finite(data.get("tokens")) or 0),
                  _finite(data.get("seconds")) or 0.0, _finite(data.get("loss")) or math.nan)
            for _, data in _arm_rows(rows)]


def trials_of(trials: Iterable[Any]) -> list[Measurement]:
    """A forked experiment's trials (``queue.TrialView``) as measurements, by repeat."""
    out = []
    for t in trials:
        result = t.result if isinstance(t.result, dict) else {}
        run = result.get("run_id")
        out.append(Measurement(
            arm=t.arm_name, index=t.repeat, step=None,
            tokens_per_second=_pos(result.get("tokens_per_second")) if t.state == "done"
            else None,
            loss=_finite(result.get("val_loss")) if t.state == "done" else None,
            state=t.state, run_id=run if isinstance(run, int) else None))
    return sorted(out, key=lambda m: (m.index, m.arm))


def arm_means(arms: Sequence[str], measurements: Iterable[Measurement]) -> list[ArmMean]:
    """Each arm's geometric-mean tokens/s and mean loss over what it measured, in arm order."""
    ms = list(measurements)
    out = []
    for arm in arms:
        mine = [m for m in ms if m.arm == arm]
        tps = [m.tokens_per_second for m in mine if m.tokens_per_second is not None]
        losses = [m.loss for m in mine if m.loss is not None]
        out.append(ArmMean(
            arm=arm, n=len(tps),
            tokens_per_second=math.exp(sum(map(math.log, tps)) / len(tps)) if tps else None,
            loss=sum(losses) / len(losses) if losses else None))
    return out


def progress(*, mode: str, arms: Sequence[str], budget: dict[str, Any],
             measurements: Sequence[Measurement], verdict: dict[str, Any] | None) -> Progress:
    """How far the experiment has got. Interleaved: complete pairs (every arm's block of a
    round) against the pairs its budget of steps holds, and the last block's step of the
    budget. Forked: trials ended against trials planned."""
    if mode == "forked":
        ended = [m for m in measurements if m.state in TRIAL_ENDED]
        failed = sum(m.state == "failed" for m in ended)
        return Progress(done=len(ended), of=len(measurements), unit="trials",
                        detail=f"{failed} failed" if failed else "")
    steps, block = budget.get("steps"), budget.get("block_steps")
    n = len(arms)
    rounds: dict[int, set[str]] = {}
    for m in measurements:
        rounds.setdefault(m.index // max(n, 1), set()).add(m.arm)
    done = sum(len(r) == n for r in rounds.values())
    # A verdict counts its pairs after dropping blocks without a throughput, and with those
    # it carried from earlier experiments (not this one's budget); the larger is what has run.
    for v in (verdict or {}).values():
        if isinstance(v, dict) and isinstance(v.get("pairs"), int):
            done = max(done, own_pairs(v))
    of = (budget_pairs(steps, block, n) if isinstance(steps, int) and isinstance(block, int)
          and block > 0 and n >= 2 else None)
    last = max((m.step for m in measurements if m.step is not None), default=None)
    detail = (f"step {last:,} of {steps:,}" if last is not None and isinstance(steps, int)
              else "")
    return Progress(done=done, of=of, unit="pairs", detail=detail)


def summarise(*, mode: str, arms: Sequence[str], budget: dict[str, Any],
              measurements: Sequence[Measurement],
              verdict: dict[str, Any] | None) -> ExperimentEvidence:
    """The page's evidence: the measurements, each arm's means and the progress."""
    return ExperimentEvidence(
        measurements=tuple(measurements), means=tuple(arm_means(arms, measurements)),
        progress=progress(mode=mode, arms=arms, budget=budget, measurements=measurements,
                          verdict=verdict))


def _finite(v: Any) -> float | None:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    return float(v) if math.isfinite(v) else None


def _pos(v: Any) -> float | None:
    x = _finite(v)
    return x if x is not None and x > 0 else None
