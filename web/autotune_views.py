"""Pure view shaping for auto-tuning searches, promotions and the trial queue.

Plain values in (the service's frozen views), display rows out, so the templates hold no
logic and the tests check these functions with tables of cases. A round as the daemon stores
it: ``{stage, phase, index, baseline, challengers, steps, experiment_id, verdicts, speed}`` where
each setting is ``{precision, compression: {method, ...params}, bucket_mb}`` and ``verdicts``
maps a challenger's arm name to its verdict (None while the round's experiment runs); a
``quality`` round's verdicts are forked trials', read for their quality status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traind.contracts.states import AUTOTUNE_STATES, PROMOTION_STATES
from traind.daemon.autotune.search import quality_status, runs_forked, setting_label
from traind.web.views import DASH, fmt_time, verdict_badge

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from traind.daemon.service import AutotuneInfo, PromotionView, QueuedTrial

# A promotion's state to a badge colour (see style.css).
_PROMOTION_BADGE = {"pending": "queued", "applied": "running", "kept": "completed",
                    "rolling_back": "stopped", "rolled_back": "failed", "refused": "failed",
                    "superseded": "cancelled", "unchanged": "cancelled"}
# The best of a search that nothing beat (the daemon marks it so when the search ends).
BASELINE_KEPT = "nothing beat the baseline"


def best_label(best: Mapping[str, Any] | None) -> str:
    """The best setting, and when it is the untested baseline, that it is; when no running
    job can take it (a mesh), what to start one with."""
    label = setting_label(best)
    if best and best.get("needs_restart"):
        return f"{label} (not promoted: {best['needs_restart']})"
    return f"{label} ({BASELINE_KEPT})" if best and best.get("nothing_beat_baseline") else label


def candidate_name(c: Mapping[str, Any]) -> str:
    """The arm name the daemon gave a candidate (``bf16.int8``, ``fp32.powersgd-rank4``),
    which keys a round's verdicts."""
    return str(c.get("name") or "?")


@dataclass(frozen=True, slots=True)
class ChallengerView:
    name: str
    setting: str
    kind: str  # a verdict kind, "running", or "failed (error)" when the round gave none
    badge: str
    ratio: str
    interval: str
    reason: str
    quality: str = ""  # a quality round's reading: non-inferior, harm, not shown ("": none)
    quality_badge: str = ""


# A quality status to a badge colour, as verdict_badge does for kinds.
_QUALITY_BADGE = {"non-inferior": "completed", "harm": "failed", "not shown": "queued"}


@dataclass(frozen=True, slots=True)
class RoundView:
    stage: str
    phase: str  # what the round asks, and how: "speed · interleaved", "quality · forked"
    number: int  # 1-based within its stage and phase
    steps: str
    baseline: str
    experiment_id: int | None
    running: bool
    challengers: tuple[ChallengerView, ...]


def challenger_view(c: Mapping[str, Any], verdicts: Mapping[str, Any] | None, *,
                    quality: bool = False) -> ChallengerView:
    name = candidate_name(c)
    if verdicts is None:
        v: Mapping[str, Any] = {"kind": "running"}
    else:
        # The tuner counts a challenger without a verdict as failed: show it so.
        v = verdicts.get(name) or {"kind": "failed (error)",
                                   "reason": "the round's experiment gave no verdict for it"}
    kind = str(v.get("kind", "pending"))
    ratio, low, high = (_num(v.get(k)) for k in ("ratio", "low", "high"))
    status = (quality_status(v) or "") if quality and kind != "running" else ""
    return ChallengerView(
        name=name, setting=setting_label(c), kind=kind, badge=verdict_badge(kind),
        ratio=DASH if ratio is None else f"{ratio:.3f}\u00d7",
        interval=DASH if low is None or high is None else f"{low:.3f} {DASH} {high:.3f}",
        reason=str(v.get("reason", "")),
        quality=status, quality_badge=_QUALITY_BADGE.get(status, ""),
    )


def round_view(r: Mapping[str, Any]) -> RoundView:
    verdicts = r.get("verdicts")
    stage, phase = str(r.get("stage", "")), str(r.get("phase") or "speed")
    return RoundView(
        stage=stage,
        phase=f"{phase} \u00b7 {'forked' if runs_forked(stage, phase) else 'interleaved'}",
        number=int(r.get("index", 0)) + 1,
        steps=f"{r['steps']:,}" if isinstance(r.get("steps"), int) else DASH,
        baseline=setting_label(r.get("baseline")),
        experiment_id=r.get("experiment_id"),
        running=verdicts is None,
        challengers=tuple(challenger_view(c, verdicts, quality=phase == "quality")
                          for c in r.get("challengers") or ()),
    )


@dataclass(frozen=True, slots=True)
class AutotuneRow:
    id: int
    name: str
    state: str
    ended: bool
    best: str
    rounds: tuple[RoundView, ...]
    infeasible: tuple[tuple[str, str], ...]  # (candidate, reason)
    error: str | None
    target_run_id: int | None
    created: str
    finished: str
    config_hash: str
    versions: tuple[tuple[str, str], ...]


def autotune_row(info: AutotuneInfo) -> AutotuneRow:
    return AutotuneRow(
        id=info.id,
        name=info.name,
        state=info.state if info.state in AUTOTUNE_STATES else "unknown",
        ended=info.state != "running",
        best=best_label(info.best),
        rounds=tuple(round_view(r) for r in info.rounds),
        infeasible=tuple((str(x.get("candidate", "")), str(x.get("reason", "")))
                         for x in info.infeasible),
        error=info.error,
        target_run_id=info.target_run_id,
        created=fmt_time(info.created_at),
        finished=fmt_time(info.finished_at),
        config_hash=info.config_hash,
        versions=tuple(sorted(info.versions.items())),
    )


@dataclass(frozen=True, slots=True)
class PromotionRow:
    id: int
    run_id: int
    autotune_id: int | None
    state: str
    badge: str
    setting: str
    previous: str
    applied_step: str
    reason: str
    created: str
    basis: str  # "config a1b2c3d4 · traind 0.1, torch 2.13, cpu"; the evidence's if it differs
    basis_title: str  # the full hashes, for the tooltip


def _stamp(config_hash: str | None, versions: Mapping[str, str] | None) -> str:
    if config_hash is None:
        return "not recorded"
    parts = ", ".join(f"{k} {versions[k]}" for k in sorted(versions)) if versions else ""
    return f"config {config_hash[:8]}" + (f" \u00b7 {parts}" if parts else "")


def basis_text(p: PromotionView) -> tuple[str, str]:
    """What a promotion rests on, as the table shows it: the target job's config hash and
    versions, then the evidence's ("same" when they agree, "none" without measured
    evidence); and the full hashes for the cell's tooltip."""
    job = _stamp(p.config_hash, p.versions)
    if p.evidence_config_hash is None:
        evidence = "none"
    elif (p.evidence_config_hash, p.evidence_versions) == (p.config_hash, p.versions):
        evidence = "same"
    else:
        evidence = _stamp(p.evidence_config_hash, p.evidence_versions)
    title = f"job {p.config_hash or DASH}; evidence {p.evidence_config_hash or DASH}"
    return f"job {job}; evidence {evidence}", title


def promotion_row(p: PromotionView) -> PromotionRow:
    basis, title = basis_text(p)
    return PromotionRow(
        id=p.id, run_id=p.run_id, autotune_id=p.autotune_id,
        state=p.state if p.state in PROMOTION_STATES else "unknown",
        badge=_PROMOTION_BADGE.get(p.state, "queued"),
        setting=setting_label(p.setting), previous=setting_label(p.previous),
        applied_step=DASH if p.applied_step is None else f"{p.applied_step:,}",
        reason=p.reason or "", created=fmt_time(p.created_at), basis=basis,
        basis_title=title,
    )


@dataclass(frozen=True, slots=True)
class QueueRow:
    id: int
    experiment_id: int
    experiment: str
    arm: str
    repeat: int
    up: tuple[int, int] | None  # (this, the one before): their new order; None: first
    down: tuple[int, int] | None  # (the one after, this)


def queue_rows(trials: Sequence[QueuedTrial]) -> list[QueueRow]:
    """The waiting trials in claim order, each with the two ids its "up" and "down" buttons
    post: the reorder swaps the slots of the trials it names and leaves the rest in place,
    so a button names only its pair, and the page stays linear in the queue's length."""
    rows = []
    for i, t in enumerate(trials):
        rows.append(QueueRow(
            id=t.id, experiment_id=t.experiment_id, experiment=t.experiment, arm=t.arm,
            repeat=t.repeat,
            up=(t.id, trials[i - 1].id) if i > 0 else None,
            down=(trials[i + 1].id, t.id) if i < len(trials) - 1 else None,
        ))
    return rows


def _num(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None
