"""Pure formatting for the templates: plain values in, display strings out.

Kept apart from the routes so the arithmetic (durations, number formats, units) is tested with
tables of cases and the templates stay free of logic. ``RunView.summary`` uses the same key
names as the hub's live messages: ``step``, ``loss``, ``val_loss``, ``tokens_per_second``.
Metric values arrive in Prometheus base units (bytes, seconds, hertz, ratios 0-1); the ``fmt_``
functions below turn them into what people read (GiB, ms, MHz, %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from traind.contracts.states import EXPERIMENT_STATES, RUN_STATES
from traind.daemon.experiments.bands import (
    auto_band,
    band_label,
    budget_pairs,
    measured_noise,
    node_noise,
)
from traind.daemon.experiments.stats import pairs_to_equivalence
from traind.metrics.host import oversubscribed

if TYPE_CHECKING:
    from collections.abc import Iterable

    from traind.daemon.service import ExperimentInfo, RunView

DASH = "\u2013"  # an en dash, shown for a value that does not exist (yet)


def fmt_time(t: datetime | None) -> str:
    """UTC to the minute: seconds would widen the table, and the duration column has them."""
    if t is None:
        return DASH
    return _aware(t).astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def fmt_duration(seconds: float | None) -> str:
    """``42s``, ``3m 07s``, ``2h 05m``, ``3d 4h``: precise enough to compare runs at a glance."""
    if seconds is None or seconds < 0 or math.isnan(seconds):
        return DASH
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def run_seconds(run: RunView, now: datetime) -> float | None:
    """Wall time of a run; a running one counts up to ``now``."""
    if run.started_at is None:
        return None
    end = run.finished_at or now
    return (_aware(end) - _aware(run.started_at)).total_seconds()


def fmt_number(value: Any, digits: int = 4) -> str:
    """Losses and norms: fixed decimals for ordinary values, scientific when tiny or huge."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return DASH
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v != 0 and (abs(v) < 10**-digits or abs(v) >= 1e6):
        return f"{v:.{max(digits - 1, 1)}e}"
    return f"{v:.{digits}f}"


def fmt_count(value: Any) -> str:
    """Steps and tokens/s: whole numbers with thousands separators."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return DASH
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{round(value):,}"


def _finite(value: Any) -> float | None:
    """The value as a float, or None for what a unit formatter cannot show (missing, NaN)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    v = float(value)
    return None if math.isnan(v) or math.isinf(v) else v


# Binary prefixes: NVML, /proc and psutil count memory in powers of two, and so do people
# reading "80 GiB" off a GPU's spec sheet.
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(value: Any) -> str:
    """``512 B``, ``1.5 KiB``, ``79.6 GiB``: one decimal above a KiB."""
    v = _finite(value)
    if v is None:
        return DASH
    n, i = abs(v), 0
    while n >= 1024 and i < len(_BINARY) - 1:
        n /= 1024
        i += 1
    sign = "-" if v < 0 else ""
    return f"{sign}{n:.0f} B" if i == 0 else f"{sign}{n:.1f} {_BINARY[i]}"


def fmt_size(value: Any) -> str:
    """Message sizes of the probe, exact powers of two: ``4 KiB``, ``64 MiB``, ``1.5 MiB``."""
    v = _finite(value)
    if v is None:
        return DASH
    n, i = v, 0
    while n >= 1024 and i < len(_BINARY) - 1:
        n /= 1024
        i += 1
    return f"{n:g} {_BINARY[i]}"


def fmt_rate(value: Any) -> str:
    """Bytes per second, same prefixes as :func:`fmt_bytes`."""
    return DASH if _finite(value) is None else f"{fmt_bytes(value)}/s"


def fmt_percent(value: Any) -> str:
    """A 0-1 ratio as a percentage: ``42%``, ``7.5%``, ``0.034%`` (small errors keep 2 digits)."""
    v = _finite(value)
    if v is None:
        return DASH
    pct = v * 100
    if pct == 0 or abs(pct) >= 10:
        return f"{pct:.0f}%"
    if abs(pct) >= 1:
        return f"{pct:.1f}%"
    return f"{pct:.2g}%"


def fmt_hertz(value: Any) -> str:
    """Clocks in MHz, as nvidia-smi shows them: ``1,980 MHz``."""
    v = _finite(value)
    return DASH if v is None else f"{v / 1e6:,.0f} MHz"


def fmt_watts(value: Any) -> str:
    v = _finite(value)
    return DASH if v is None else f"{v:,.0f} W"


def fmt_celsius(value: Any) -> str:
    v = _finite(value)
    return DASH if v is None else f"{v:.0f} \u00b0C"


def fmt_seconds(value: Any) -> str:
    """Latencies and accumulated time: ``85 µs``, ``4.2 ms``, ``12.35 s``, then ``3m 07s``."""
    v = _finite(value)
    if v is None or v < 0:
        return DASH
    if v == 0:
        return "0 s"
    if v < 1e-3:
        return f"{v * 1e6:.3g} \u00b5s"
    if v < 1:
        return f"{v * 1e3:.3g} ms"
    if v < 60:
        return f"{v:.2f} s"
    return fmt_duration(v)


def fmt_factor(value: Any) -> str:
    """Compression ratios: ``4.0x`` with a times sign (raw over sent; 1 is uncompressed)."""
    v = _finite(value)
    return DASH if v is None else f"{v:.1f}\u00d7"


def bar_percent(part: Any, whole: Any = 1.0) -> float | None:
    """Width of a bar in percent, clamped to 0-100; None when either side is unknown or the
    whole is 0 (a bar of nothing would claim a share it does not have)."""
    p, w = _finite(part), _finite(whole)
    if p is None or w is None or w <= 0:
        return None
    return max(0.0, min(100.0, 100 * p / w))


@dataclass(frozen=True, slots=True)
class RunRow:
    """One run as the templates show it: every field already a display string."""

    id: int
    name: str
    state: str
    created: str
    started: str
    finished: str
    duration: str
    step: str
    loss: str
    val_loss: str
    tokens_per_second: str
    exit_code: str
    error: str | None
    started_iso: str  # "" when not started: the overview's clock ticks from it
    finished_iso: str
    # Interleaved A/B verdicts: (arm, kind, reason), from the summary's "ab".
    ab: tuple[tuple[str, str, str], ...] = ()
    warnings: tuple[str, ...] = ()  # CPU oversubscription (cpu_warnings)
    goodput: str = DASH  # productive / wall (metrics/goodput.py), from the summary
    ettr: str = DASH  # effective training time ratio
    mfu: str = DASH  # model FLOP/s over the sum of the devices' peaks (metrics/throughput.mfu)


# A host check is a moment's reading (one runnable count a second): a run is said to have
# trained on an oversubscribed host only when most of its checks, and a few of them, say so.
HOST_CHECKS_MIN = 5
HOST_OVERSUBSCRIBED_SHARE = 0.5


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cpu_warnings(s: dict[str, Any]) -> tuple[str, ...]:
    """Why a run's steps waited for CPUs, from its summary (daemon/runs/summary.py): its own
    ranks x threads above the node's usable CPUs, or a host with more runnable threads than
    CPUs through most of its training. Empty for a summary without those fields."""
    out = []
    ranks, threads, cpus = (_count(s.get(k)) for k in ("ranks_per_node", "threads",
                                                        "usable_cpus"))
    if ranks and threads and cpus and oversubscribed(ranks * threads, cpus):
        fit = max(1, cpus // ranks)
        out.append(f"{ranks} rank{'s' * (ranks > 1)} \u00d7 {threads} threads on {cpus} usable "
                   f"CPU{'s' * (cpus > 1)}: threads wait for a CPU "
                   f"(job.threads={fit}, or 0 for the default, fits)")
    checks, over = _count(s.get("host_checks")) or 0, _count(s.get("host_oversubscribed")) or 0
    if checks >= HOST_CHECKS_MIN and over >= HOST_OVERSUBSCRIBED_SHARE * checks:
        where = f"its {cpus} usable CPUs" if cpus else "its usable CPUs"
        out.append(f"the host had more runnable threads than {where} in {over} of {checks} "
                   "checks while this run trained: outside load slowed it, and its tokens/s "
                   "are not those of a quiet node")
    return tuple(out)


def run_row(run: RunView, now: datetime) -> RunRow:
    s = run.summary
    goodput = s.get("goodput") or {}  # metrics/goodput.Goodput.as_dict
    return RunRow(
        id=run.id,
        name=run.name,
        # An unknown state still renders, with a neutral badge (see style.css .badge).
        state=run.state if run.state in RUN_STATES else "unknown",
        created=fmt_time(run.created_at),
        started=fmt_time(run.started_at),
        finished=fmt_time(run.finished_at),
        duration=fmt_duration(run_seconds(run, now)),
        step=fmt_count(s.get("step")),
        loss=fmt_number(s.get("loss")),
        val_loss=fmt_number(s.get("val_loss")),
        tokens_per_second=fmt_count(s.get("tokens_per_second")),
        exit_code=DASH if run.exit_code is None else str(run.exit_code),
        error=run.error if run.state == "failed" and run.error else None,
        started_iso=_aware(run.started_at).isoformat() if run.started_at else "",
        finished_iso=_aware(run.finished_at).isoformat() if run.finished_at else "",
        ab=tuple((arm, str(v.get("kind", "")), str(v.get("reason", "")))
                 for arm, v in (s.get("ab") or {}).items()),
        warnings=cpu_warnings(s),
        goodput=fmt_percent(goodput.get("ratio")),
        ettr=fmt_percent(goodput.get("ettr")),
        mfu=fmt_percent(s.get("mfu")),
    )


ENDED = frozenset({"done", "cancelled", "failed"})
VERDICT_FIELDS = ("arm", "kind", "ratio", "low", "high", "p_value", "reason", "interval")
# A verdict's kind (traind.daemon.experiments.stats.KINDS, or "running") to a badge colour.
_KIND_BADGE = {"better": "completed", "worse": "failed", "rejected (quality)": "failed",
               "failed (error)": "failed", "running": "running", "cancelled": "cancelled",
               "failed": "failed"}

# A verdict kind (daemon/experiments/stats.py KINDS, or a state) as the page words it: "worse"
# means shown slower, and a verdict that only lacks data says what would settle it.
KIND_WORDS = {
    "better": "better",
    "worse": "worse: shown slower",
    "no difference": "no difference",
    "no gain": "no gain: cannot reach the smallest effect worth having",
    "inconclusive (budget spent)": "inconclusive: needs more steps",
    "not shown (budget spent)": "faster, quality not shown non-inferior: needs more steps",
    "rejected (quality)": "rejected: loss shown worse",
    "failed (error)": "failed (error)",
}

# A quality check's status (stats.NonInferiority.status) in words.
QUALITY_WORDS = {
    "non-inferior": "non-inferior",
    "harm": "worse by more than the margin (harm shown)",
    "not shown": "not shown non-inferior (needs more steps)",
}


def kind_words(kind: str) -> str:
    return KIND_WORDS.get(kind, kind)


def quality_words(record: Any) -> str:
    """``loss (shared weights): non-inferior`` from a verdict's stored quality check."""
    q = record.get("quality") if isinstance(record, dict) else None
    if not isinstance(q, dict):
        return "not checked"
    words = QUALITY_WORDS.get(str(q.get("status")), str(q.get("status", DASH)))
    return f"{q.get('measure', 'loss')}: {words}"


def verdict_badge(kind: str) -> str:
    """The badge colour of a verdict kind; unknown kinds stay neutral."""
    return _KIND_BADGE.get(kind, "queued")


UNDECIDED = frozenset({"pending", "running"})


def verdict_rows(info: ExperimentInfo) -> list[dict[str, Any]]:
    """Each non-baseline arm's verdict as plain values, in arm order (the export's rows);
    an arm without a verdict yet is ``pending``. In an experiment that was cancelled or
    failed, an undecided arm says so: its last "1.26x so far" is no verdict, and reads as
    one that is still coming."""
    verdict = info.verdict or {}
    ended = info.state if info.state in ("cancelled", "failed") else None
    rows = []
    for arm in info.arms[1:]:
        v = verdict.get(arm) or {}
        kind, reason = str(v.get("kind", "pending")), str(v.get("reason", ""))
        if ended and kind in UNDECIDED:
            last = f"; when it stopped: {reason}" if reason else ""
            kind, reason = ended, f"the experiment was {ended} before {arm} was decided{last}"
        rows.append({
            "arm": arm,
            "kind": kind,
            **{k: _finite(v.get(k)) for k in ("ratio", "low", "high", "p_value")},
            "reason": reason,
            "interval": str(v.get("interval", "")),
        })
    return rows


@dataclass(frozen=True, slots=True)
class VerdictView:
    arm: str
    kind: str
    badge: str  # a .badge-* colour
    ratio: str  # "1.234x", with a times sign
    interval: str  # "1.121 - 1.248", with an en dash
    p_value: str
    reason: str
    decided: str = ""  # "step 60 of 400": when the arm was decided, against its budget
    words: str = ""  # the kind as a person reads it (experimentviews.KIND_WORDS)
    quality: str = ""  # its quality check's outcome in words


def decided_label(record: Any) -> str:
    """``step 60 of 400`` from a verdict record's ``decided_at_step`` and ``budget_steps``
    (the steps a decision took); "" when the arm is not decided."""
    if not isinstance(record, dict) or not isinstance(record.get("decided_at_step"), int):
        return ""
    budget = record.get("budget_steps")
    of = f" of {budget:,}" if isinstance(budget, int) else ""
    return f"step {record['decided_at_step']:,}{of}"


@dataclass(frozen=True, slots=True)
class ExperimentRow:
    """One experiment as the templates show it."""

    id: int
    name: str
    state: str
    mode: str
    arms: tuple[str, ...]
    baseline: str
    run_id: int | None
    created: str
    finished: str
    ended: bool
    verdicts: tuple[VerdictView, ...]
    config_hash: str
    versions: tuple[tuple[str, str], ...]
    band: str = DASH  # the equivalence band and how it was chosen (bands.band_label)
    trial_runs: tuple[int, ...] = ()  # forked: the trials' runs, in queue order
    compare: str | None = None  # the link overlaying them (up to the comparison's limit)
    reused_trials: int = 0  # forked: trials taken from earlier experiments (their runs)
    # interleaved: the experiments whose pairs its verdicts go on from, and how many (at most)
    carried_from: tuple[int, ...] = ()
    carried_pairs: int = 0


COMPARE_MAX = 8  # runs one comparison overlays (web/runviews.py checks it)


def compare_href(run_ids: Iterable[int]) -> str | None:
    """The comparison of these runs (the first COMPARE_MAX), or None for fewer than two."""
    ids = list(dict.fromkeys(run_ids))[:COMPARE_MAX]
    return "/runs/compare?" + "&".join(f"ids={i}" for i in ids) if len(ids) >= 2 else None


def experiment_row(info: ExperimentInfo) -> ExperimentRow:
    verdicts = tuple(
        VerdictView(
            arm=r["arm"],
            kind=r["kind"],
            badge=verdict_badge(r["kind"]),
            ratio=DASH if r["ratio"] is None else f"{r['ratio']:.3f}\u00d7",
            interval=(DASH if r["low"] is None or r["high"] is None
                      else f"{r['low']:.3f} {DASH} {r['high']:.3f}"),
            p_value=DASH if r["p_value"] is None else f"{r['p_value']:.2g}",
            reason=r["reason"],
            decided=decided_label((info.verdict or {}).get(r["arm"])),
            words=kind_words(r["kind"]),
            quality=quality_words((info.verdict or {}).get(r["arm"])),
        )
        for r in verdict_rows(info)
    )
    return ExperimentRow(
        id=info.id,
        name=info.name,
        state=info.state if info.state in EXPERIMENT_STATES else "unknown",
        mode=info.mode,
        arms=tuple(info.arms),
        baseline=info.arms[0] if info.arms else DASH,
        run_id=info.run_id,
        created=fmt_time(info.created_at),
        finished=fmt_time(info.finished_at),
        ended=info.state in ENDED,
        verdicts=verdicts,
        config_hash=info.config_hash,
        versions=tuple(sorted(info.versions.items())),
        band=band_label(info.equivalence, info.equivalence_rule),
        trial_runs=info.trial_runs,
        compare=compare_href(info.trial_runs),
        reused_trials=info.reused_trials,
        carried_from=info.carried_from,
        carried_pairs=info.carried_pairs,
    )


def verdict_chart(info: ExperimentInfo) -> dict[str, Any]:
    """The speed-up chart's data: ratio with its interval per arm that has all three."""
    rows = [r for r in verdict_rows(info)
            if r["ratio"] is not None and r["low"] is not None and r["high"] is not None]
    return {
        "baseline": info.arms[0] if info.arms else "",
        "arms": [r["arm"] for r in rows],
        "ratio": [r["ratio"] for r in rows],
        "plus": [max(r["high"] - r["ratio"], 0.0) for r in rows],
        "minus": [max(r["ratio"] - r["low"], 0.0) for r in rows],
        "kind": [r["kind"] for r in rows],
    }


def current_run(runs: list[RunView], live_run: int | None, *, chosen: int | None = None
                ) -> RunView | None:
    """The run the overview follows (``runs`` newest first): the one chosen (``?run=``), else
    the longest-training one (an experiment's short runs come and go beside a long job, and
    following the newest made the page jump between them), else the one the live series
    belong to, else the newest."""
    by_id = {r.id: r for r in runs}
    if chosen is not None and chosen in by_id:
        return by_id[chosen]
    running = [r for r in runs if r.state == "running"]
    if running:
        return running[-1]
    return by_id.get(live_run) if live_run in by_id else (runs[0] if runs else None)


def overview_choices(runs: list[RunView], shown: RunView | None) -> list[RunView]:
    """What the overview's picker offers: every training run and the one shown, oldest
    first; empty when there is nothing to choose between."""
    out = [r for r in reversed(runs) if r.state == "running" or (shown and r.id == shown.id)]
    return out if len(out) > 1 else []


def _aware(t: datetime) -> datetime:
    # The DB may hand back naive datetimes (SQLite); the daemon writes them in UTC.
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _pct(x: float) -> str:
    """0.02 -> ``2%``, 0.015 -> ``1.5%``, 0.041 -> ``4.1%``."""
    return f"{round(x * 100, 1):g}%"


def band_cost(infos: Iterable[ExperimentInfo], *, band: float | None, block_steps: int,
              steps: int | None = None, arms: int = 2) -> str | None:
    """What the form's equivalence band means at this node's noise (``bands.measured_noise``:
    the newest done interleaved experiment's), as the form says beside it. ``band`` None
    (auto): the band the budget of ``steps`` reaches, which the daemon will choose. A band:
    what it costs, in pairs and in steps (a pair per round of ``arms`` blocks of
    ``block_steps``); None when nothing was measured, or the inputs are not a band and a
    block yet."""
    if not (block_steps > 0 and arms >= 2):
        return None
    infos = list(infos)
    if band is None:
        if not steps or steps <= 0:
            return None
        chosen, record = auto_band(node_noise(infos), budget_pairs(steps, block_steps, arms))
        return f"auto at this budget: \u00b1{_pct(chosen)}, {record['rule'].removeprefix('auto: ')}"
    if band <= 0:
        return None
    noise = measured_noise(infos)
    if noise is None:
        return None
    measured = f"at this node's noise ({noise.describe()})"
    pairs = pairs_to_equivalence(noise.value, band)
    if pairs is None:
        return f"{measured} \u00b1{_pct(band)} is out of reach: widen the band"
    return (f"{measured} \u00b1{_pct(band)} needs about {pairs:,} pairs "
            f"({pairs * arms * block_steps:,} steps)")
