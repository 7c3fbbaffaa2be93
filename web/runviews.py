"""Pure formatting for a run's page: its config as dotted keys, its events as lines, its
experiments as links. The charts are drawn in the browser from /api/runs/{id}/series."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from traind.web.dataviews import DataView, data_view
from traind.web.views import (
    COMPARE_MAX,
    DASH,
    RunRow,
    fmt_number,
    fmt_percent,
    fmt_seconds,
    run_row,
)

if TYPE_CHECKING:
    from traind.daemon.service import RunDetail, RunQuery

STOPPABLE = frozenset({"queued", "running"})


@dataclass(frozen=True, slots=True)
class EventRow:
    kind: str
    step: int
    time: str
    text: str


@dataclass(frozen=True, slots=True)
class RunPage:
    run: RunRow
    kind: str
    node: str
    config: tuple[tuple[str, str], ...]  # ("job.steps", "40"), in the config's own order
    events: tuple[EventRow, ...]
    experiments: tuple[dict[str, Any], ...]
    log_tail: str
    stoppable: bool  # running on this node
    ranks: int = 1  # the job's world size: more than one offers its lines per rank
    goodput: GoodputView | None = None  # where its wall time went; None before a report
    straggler: StragglerNote | None = None  # the verdict (multi-rank DDP runs)
    data: DataView | None = None  # what it trains on, filters and cache tiers


# How the page names each bucket of metrics/goodput.py, productive first, and what it holds.
GOODPUT_LABELS = {
    "productive": ("Productive training", "steps that count: trained once and kept"),
    "startup": ("Start-up", "launch to the first step: launcher, imports, model build"),
    "restart": ("Restart", "a failed attempt's last report to its relaunch"),
    "data_wait": ("Data wait", "the loop waiting for batches"),
    "checkpoint_save": ("Checkpoint save", "writing checkpoints"),
    "checkpoint_restore": ("Checkpoint restore", "loading a checkpoint to resume or roll back"),
    "evaluation": ("Evaluation", "validation loss"),
    "progress_lost": ("Progress lost", "steps trained again after a restart or rollback"),
    "numerics_skip": ("Numerics skips", "steps whose update was dropped"),
    "profiling": ("Profiling", "writing the traces of a profile asked for on demand"),
    "shutdown": ("Shutdown", "the last report to the end"),
}


@dataclass(frozen=True, slots=True)
class GoodputRow:
    kind: str  # "productive" or a badput kind
    label: str
    note: str
    seconds: str
    share: float  # percent of the wall time, 0-100 (the bar's width)
    percent: str


@dataclass(frozen=True, slots=True)
class GoodputView:
    ratio: str
    ettr: str
    wall: str
    attempts: int
    rows: tuple[GoodputRow, ...]  # productive, then badput by size; empty buckets left out


@dataclass(frozen=True, slots=True)
class StragglerNote:
    text: str
    named: bool  # a rank is named (the page warns), or chance explains the most-often-last


def straggler_note(v: Any) -> StragglerNote | None:
    """The summary's straggler verdict (metrics/straggler.py) as one sentence; None before
    any step's every arrival was in."""
    if not isinstance(v, dict) or not v.get("steps"):
        return None
    return StragglerNote(_straggler_text(v), isinstance(v.get("rank"), int))


def _straggler_text(v: dict[str, Any]) -> str:
    ms = fmt_seconds(v.get("lag"))
    judged = (f"last at the gradient collectives in {fmt_percent(v.get('share'))} of the "
              f"last {v['steps']} steps")
    if isinstance(v.get("rank"), int):
        return (f"Rank {v['rank']} is the straggler: {judged}, by {ms} (median); chance "
                f"would do that with p = {fmt_number(1 - float(v.get('confidence', 0)), 2)}. "
                f"Every other rank waits that long each step.")
    return (f"No straggler: the most often last, rank {v.get('candidate')}, was {judged} "
            f"(by {ms}), which chance or the clocks' error "
            f"({fmt_seconds(v.get('error'))}) explains.")


def goodput_view(figures: Any) -> GoodputView | None:
    """The summary's goodput (``Goodput.as_dict``) as the run page shows it: a bar of the
    wall time split by bucket and a table of the same."""
    if not isinstance(figures, dict) or not isinstance(figures.get("wall"), int | float):
        return None
    wall = float(figures["wall"])
    parts = {"productive": float(figures.get("productive") or 0.0)}
    badput = figures.get("badput") or {}
    parts.update(sorted(((k, float(v)) for k, v in badput.items()
                         if k in GOODPUT_LABELS and isinstance(v, int | float) and v > 0),
                        key=lambda kv: -kv[1]))
    rows = tuple(GoodputRow(kind=k, label=GOODPUT_LABELS[k][0], note=GOODPUT_LABELS[k][1],
                            seconds=fmt_seconds(v),
                            share=round(100 * v / wall, 2) if wall > 0 else 0.0,
                            percent=fmt_percent(v / wall if wall > 0 else None))
                 for k, v in parts.items())
    return GoodputView(ratio=fmt_percent(figures.get("ratio")),
                       ettr=fmt_percent(figures.get("ettr")), wall=fmt_seconds(wall),
                       attempts=_int(figures.get("attempts"), 1), rows=rows)


def config_rows(config: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Nested config sections as ``(dotted key, JSON value)``: one line per setting, so two
    runs' configs diff line by line (and read as the ``--set`` flags that made them)."""
    out: list[tuple[str, str]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += config_rows(value, name + ".")
        else:
            out.append((name, json.dumps(value, sort_keys=True)))
    return out


def event_text(kind: str, data: dict[str, Any]) -> str:
    """One event's line: what a reader needs first, then the rest of its detail."""
    if kind == "numerics":
        line = f"{data.get('action', '?')} ({data.get('reason', '?')})"
        if data.get("action") == "rollback":
            line += (f": back to step {data.get('resume_step')}, "
                     f"{data.get('skipped_batches', 0)} batches left out")
        return line
    if kind == "checkpoint":
        took = fmt_seconds(data.get("seconds")) if "seconds" in data else DASH
        return f"{data.get('path', '')} ({took}{', sharded' if data.get('sharded') else ''})"
    if kind == "resumed":
        return f"from step {data.get('step')} ({data.get('path', '')})"
    if kind == "finished":
        how = "stopped" if data.get("stopped") else "finished"
        return (f"{how}: loss {fmt_number(data.get('loss'))}, val loss "
                f"{fmt_number(data.get('val_loss'))}")
    return ", ".join(f"{k}={_short(v)}" for k, v in data.items())


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def run_page(detail: RunDetail, now: datetime) -> RunPage:
    return RunPage(
        run=run_row(detail.run, now), kind=detail.kind, node=detail.node or DASH,
        config=tuple(config_rows(detail.config)),
        events=tuple(EventRow(kind=e["kind"], step=e["step"], time=_clock(e["time"]),
                              text=event_text(e["kind"], e["data"] or {}))
                     for e in detail.events),
        experiments=tuple(detail.experiments), log_tail=detail.log_tail,
        stoppable=detail.running_here and detail.run.state in STOPPABLE,
        ranks=_int(detail.run.summary.get("world_size"), 1),
        goodput=goodput_view(detail.run.summary.get("goodput")),
        straggler=straggler_note(detail.run.summary.get("straggler")),
        data=data_view(detail.run.summary.get("data")))


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _clock(t: datetime | None) -> str:
    if t is None:
        return DASH
    aware = t.replace(tzinfo=UTC) if t.tzinfo is None else t
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


# The runs table's columns: (heading, sort key or None, numeric).
RUN_COLUMNS = (("ID", "id", True), ("Name", "name", False), ("State", "state", False),
               ("Created", "created_at", False), ("Started", "started_at", False),
               ("Finished", "finished_at", False), ("Duration", None, True),
               ("Step", "step", True), ("Loss", "loss", True), ("Val loss", "val_loss", True),
               ("Tokens/s", "tokens_per_second", True), ("Exit", None, True))


def runs_href(q: RunQuery, page: int = 1) -> str:
    """The runs page showing ``q`` at ``page``: only what differs from the defaults."""
    params: dict[str, Any] = {}
    if q.state:
        params["state"] = q.state
    if q.name:
        params["name"] = q.name
    if q.experiment is not None:
        params["experiment"] = q.experiment
    if q.config is not None:
        params["config"] = str(q.config)
    if q.sort != "id" or not q.descending:
        params["sort"], params["order"] = q.sort, "desc" if q.descending else "asc"
    if page > 1:
        params["page"] = page
    return "/runs" + (f"?{urlencode(params)}" if params else "")


def sort_href(q: RunQuery, key: str) -> str:
    """A heading's link: by that column, largest first; the current column flips its order."""
    descending = not q.descending if q.sort == key else key not in ("name", "state")
    return runs_href(replace(q, sort=key, descending=descending))


def pages(total: int, per_page: int) -> int:
    return max(1, -(-total // per_page))


PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7")  # colour-blind-safe, Tableau's order; static/run.js reads it from the page


def config_differences(configs: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The dotted keys whose value is not the same in every config, each with its value per
    config (an en dash where a config lacks the key), in the first config's order."""
    rows = [dict(config_rows(c)) for c in configs]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return [(k, [r.get(k, DASH) for r in rows]) for k in keys
            if len({r.get(k, DASH) for r in rows}) > 1]


def compare_ids(ids: list[int]) -> list[int]:
    """The runs to compare, in the order given, each once; ``ValueError`` names the field."""
    unique = list(dict.fromkeys(ids))
    if not 2 <= len(unique) <= COMPARE_MAX:
        raise ValueError(f"ids: choose 2 to {COMPARE_MAX} runs to compare, not {len(unique)}")
    return unique


LEGEND_KEYS = 2  # differing settings a legend entry names (the table below lists them all)
_NAMING = (".name", "out_dir")  # keys that differ between any two runs: they tell nothing


def legend_names(runs: list[tuple[int, str]], differences: list[tuple[str, list[str]]]
                 ) -> dict[int, str]:
    """Each run's legend entry: ``#id name`` and the first settings in which the runs differ,
    ``#3 base · precision.mode="bf16"``."""
    telling = [(k, vs) for k, vs in differences if not k.endswith(_NAMING)][:LEGEND_KEYS]
    return {rid: " · ".join([f"#{rid} {name}", *(f"{k}={vs[i]}" for k, vs in telling)])
            for i, (rid, name) in enumerate(runs)}
