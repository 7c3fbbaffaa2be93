"""An experiment's page beside its verdict: what each verdict's words and interval mean, each
arm's means, its progress, and its per-block (or per-trial) throughput chart. Pure: the
service's frozen views in, display values out (web/views.py holds the verdict rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traind.web.runviews import PALETTE
from traind.web.views import DASH, bar_percent, fmt_count, fmt_number

if TYPE_CHECKING:
    from traind.daemon.service import ExperimentEvidence, ExperimentInfo, Progress

# What a stored verdict's interval was when its record predates naming it.
_DEFAULT_INTERVAL = {"interleaved": "95% always-valid confidence sequence",
                     "forked": "95% t interval"}


def interval_note(info: ExperimentInfo) -> str:
    """What the page's interval and p are: one test behind both, named once."""
    names = {str(v.get("interval")) for v in (info.verdict or {}).values()
             if isinstance(v, dict) and v.get("interval")}
    name = ", ".join(sorted(names)) or _DEFAULT_INTERVAL.get(info.mode, "95% interval")
    if "always-valid" in name:
        return (f"Interval: {name}; p: the always-valid p of the same sequential test. Both "
                "stay valid however often they are read, so the run may stop at any block.")
    return (f"Interval: {name}; p: the same test's, read once at the end of the trials "
            "(the interval excludes 1 exactly when p is below 0.05).")


@dataclass(frozen=True, slots=True)
class MeanRow:
    arm: str
    baseline: bool
    n: str  # blocks or trials measured
    tokens_per_second: str
    ratio: str  # this arm's mean over the baseline's ("1.000x" for the baseline)
    loss: str


def mean_rows(evidence: ExperimentEvidence) -> list[MeanRow]:
    means = evidence.means
    base = means[0].tokens_per_second if means else None
    rows = []
    for i, m in enumerate(means):
        t = m.tokens_per_second
        rows.append(MeanRow(
            arm=m.arm, baseline=i == 0, n=fmt_count(m.n), tokens_per_second=fmt_count(t),
            ratio=DASH if t is None or not base else f"{t / base:.3f}\u00d7",
            loss=fmt_number(m.loss)))
    return rows


def progress_label(p: Progress) -> str:
    """``12 of 30 pairs · step 480 of 1,200``; ``5 of 8 trials · 1 failed``."""
    of = f" of {p.of:,}" if p.of is not None else ""
    return f"{p.done:,}{of} {p.unit}" + (f" \u00b7 {p.detail}" if p.detail else "")


def progress_percent(p: Progress) -> float | None:
    return bar_percent(p.done, p.of) if p.of else None


def blocks_chart(info: ExperimentInfo, evidence: ExperimentEvidence) -> dict[str, Any]:
    """Each arm's throughput per block (interleaved: x the block, in run order) or per trial
    (forked: x the repeat), a line and colour per arm, for static/experiment.js."""
    forked = info.mode == "forked"
    traces = []
    for i, arm in enumerate(info.arms):
        mine = [m for m in evidence.measurements
                if m.arm == arm and m.tokens_per_second is not None]
        traces.append({
            "name": arm + (" (baseline)" if i == 0 else ""),
            "color": PALETTE[i % len(PALETTE)],
            "x": [m.index + 1 if forked else m.index for m in mine],
            "y": [m.tokens_per_second for m in mine],
            "loss": [m.loss for m in mine],
            "step": [m.step for m in mine],
        })
    return {"x_title": "repeat" if forked else "block",
            "traces": [t for t in traces if t["x"]]}
