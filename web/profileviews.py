"""A profile capture's report page, made ready for its template: pure functions of the capture
(daemon/service.Capture) and its report (daemon/profiles/analysis.report's dict)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from traind.contracts.control import PROFILE_STEPS_MAX
from traind.daemon.service import rank_list
from traind.errors import FieldErrors
from traind.web.views import DASH, fmt_bytes, fmt_percent, fmt_seconds, fmt_time

if TYPE_CHECKING:
    from traind.daemon.service import Capture

# What the page says while a capture is not ready, by state.
STATE_NOTES = {
    "waiting": "Waiting for the run's next report step, then for its ranks to trace the "
               "steps and write their traces. This page reloads until the report is ready.",
    "analysing": "The traces are in; the report is being built. This page reloads until it "
                 "is ready.",
    "incomplete": "The run (or the daemon) ended before every chosen rank wrote its trace, "
                  "and no report was built.",
    "failed": "No report could be built from this capture.",
    "ready": "",
}
# The breakdown's buckets: key in the report, label, what it holds (the bar's order).
BUCKETS = (
    ("compute_ms", "Compute", "operators (host) or kernels (device) running, with or without "
                              "communication beside them"),
    ("exposed_comm_ms", "Exposed communication", "collectives no compute overlaps"),
    ("memcpy_ms", "Memory copies", "device copies and sets alone"),
    ("idle_ms", "Idle", "neither: waiting for data, the host, or another rank"),
)


@dataclass(frozen=True, slots=True)
class Share:
    key: str
    label: str
    note: str
    ms: float
    text: str  # formatted
    percent: float  # of the window, for the bar's width


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    timeline: str
    window: str
    window_ms: float
    comm: str
    comm_ms: float
    overlap: str
    peak_memory: str
    shares: tuple[Share, ...]
    trace_url: str | None
    trace_size: str
    top_ops: tuple[dict[str, Any], ...]
    steps: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class StragglerRow:
    step: int
    arrivals: tuple[str, ...]  # per rank, in the ranks' order
    last: int
    skew: str


@dataclass(frozen=True, slots=True)
class ProfileView:
    run: int
    capture: int
    state: str
    note: str
    error: str | None
    refresh: bool
    steps: str  # "steps 12-16"
    ranks: tuple[RankRow, ...]
    rank_ids: tuple[int, ...]
    straggler: tuple[StragglerRow, ...]
    straggler_text: str
    memory: dict[str, Any]  # chart data: rank -> device -> {t_ms, mib}
    analysis: str  # how long the report took to build


def _ms(value: Any) -> str:
    return fmt_seconds(value / 1e3) if isinstance(value, int | float) else DASH


def rank_row(run: int, capture: int, r: dict[str, Any], trace_bytes: dict[str, Any]
             ) -> RankRow:
    window = float(r.get("window_ms") or 0.0)
    shares = tuple(Share(key=k, label=label, note=note, ms=float(r.get(k) or 0.0),
                         text=_ms(r.get(k)),
                         percent=round(100 * float(r.get(k) or 0.0) / window, 2)
                         if window > 0 else 0.0)
                   for k, label, note in BUCKETS
                   if k != "memcpy_ms" or r.get("timeline") == "device")
    memory = r.get("memory") or {}
    peak = max((float(m.get("peak_mib") or 0.0) for m in memory.values()), default=None)
    size = trace_bytes.get(str(r["rank"]))
    return RankRow(
        rank=int(r["rank"]), timeline=str(r.get("timeline", "host")), window=_ms(window),
        window_ms=window, comm=_ms(r.get("comm_ms")), comm_ms=float(r.get("comm_ms") or 0.0),
        overlap=fmt_percent(r.get("overlap")),
        peak_memory=fmt_bytes(peak * 2**20) if peak is not None else DASH, shares=shares,
        trace_url=f"/api/runs/{run}/profiles/{capture}/traces/{r['rank']}" if size else None,
        trace_size=fmt_bytes(size) if size else DASH,
        top_ops=tuple({"name": op["name"], "calls": op["calls"], "self": _ms(op["self_ms"]),
                       "self_ms": op["self_ms"], "share": fmt_percent(op["share"])}
                      for op in r.get("top_ops", ())),
        steps=tuple({"step": s["step"], "window": _ms(s["window_ms"]),
                     "compute": _ms(s["compute_ms"]), "comm": _ms(s["comm_ms"]),
                     "exposed": _ms(s["exposed_comm_ms"]), "idle": _ms(s["idle_ms"]),
                     "overlap": fmt_percent(s.get("overlap"))}
                    for s in r.get("steps", ())))


def straggler_text(report: dict[str, Any], ranks: int) -> str:
    rows = report.get("straggler") or []
    if ranks < 2:
        return "One rank traced: no arrivals to compare."
    if not rows:
        return "No traced step had a collective on every rank: no arrivals to compare."
    last = report["last_rank"]
    return (f"Rank {last} reached the step's first collective last in "
            f"{report['last_counts'][str(last)]} of "
            f"{len(rows)} traced steps; median skew {_ms(report.get('median_skew_ms'))} "
            "(the other ranks wait that long in it).")


def profile_view(capture: Capture, report: dict[str, Any] | None) -> ProfileView:
    report = report or {}
    trace_bytes = report.get("trace_bytes") or {}
    ranks = tuple(rank_row(capture.run, capture.capture, r, trace_bytes)
                  for r in report.get("ranks", ()))
    ids = tuple(r.rank for r in ranks)
    straggler = tuple(StragglerRow(step=int(s["step"]),
                                   arrivals=tuple(_ms(s["arrival_ms"].get(str(i),
                                                                          s["arrival_ms"].get(i)))
                                                  for i in ids),
                                   last=int(s["last"]), skew=_ms(s["skew_ms"]))
                      for s in report.get("straggler", ()))
    steps = report.get("steps") or []
    span = (f"steps {min(steps)}\u2013{max(steps)}" if len(steps) > 1
            else f"step {steps[0]}" if steps else f"{capture.steps} steps")
    return ProfileView(
        run=capture.run, capture=capture.capture, state=capture.state,
        note=STATE_NOTES.get(capture.state, ""), error=capture.error,
        refresh=capture.state in ("waiting", "analysing"), steps=span, ranks=ranks,
        rank_ids=ids, straggler=straggler, straggler_text=straggler_text(report, len(ranks)),
        memory={str(r["rank"]): r.get("memory") or {} for r in report.get("ranks", ())},
        analysis=fmt_seconds(report.get("analysis_seconds")))


@dataclass(frozen=True, slots=True)
class CaptureRow:
    capture: int
    asked: str
    steps: int
    ranks: str
    state: str


def capture_row(c: Capture) -> CaptureRow:
    return CaptureRow(capture=c.capture,
                      asked=fmt_time(datetime.fromtimestamp(c.requested, UTC))
                      if c.requested else DASH,
                      steps=c.steps, ranks=", ".join(map(str, c.ranks)) or "all",
                      state=c.state)


def profile_fields(steps: Any, ranks: Any) -> tuple[int, list[int] | None]:
    """The run page's profile form: ``steps`` and ``ranks`` ("0, 2"; empty: every rank).
    A bad value is a FieldErrors naming the field."""
    words = f"a whole number from 1 to {PROFILE_STEPS_MAX}"
    try:
        n = int(str(steps).strip())
    except ValueError:
        raise FieldErrors.at(("steps",), words) from None
    if not 1 <= n <= PROFILE_STEPS_MAX:
        raise FieldErrors.at(("steps",), f"{words} (not {n})")
    return n, rank_list(str(ranks or ""))
