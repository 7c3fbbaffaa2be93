"""A run's stored series, read back at full resolution: merged, for the export and a poll's
tail; and the straggler rule of the rank table. Pure functions.

The chunks are the rows ``daemon/ingest/series.py`` seals (columns per run and kind, oldest
first). A step seen twice (redone after a restart from a checkpoint, or after a rollback) keeps
its newest figures: the curve shows the run's history as it stands. A whole page, a few
thousand points of a run of any length, is folded as the chunks stream by instead
(``daemon/runs/series_fold.py``).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from traind.daemon.ingest.series import LAYER_COLUMNS, RANK_COLUMNS, STEP_COLUMNS

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

LAYER_COLUMNS_SHOWN = 400  # steps (columns) of a layer heat map
# Per-rank lines share a budget: 8 ranks draw 2,000 points each, 64 ranks 250 (a screen is
# ~2,000 pixels wide; past a few dozen lines each line is a texture, not a curve).
RANK_POINTS = 16_000
RANK_FIGURES = tuple(c for c in RANK_COLUMNS if c not in ("step", "rank"))
RANK_SECONDS = tuple(c for c in RANK_FIGURES if c.endswith("_seconds"))
# The slowest rank's median stands out in a phase when it is this much above the fastest's
# and by at least a millisecond (a 0.1 ms data wait doubling is no straggler).
STRAGGLER_RATIO = 1.2
STRAGGLER_SECONDS = 1e-3


def merge_steps(chunks: Iterable[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """The chunks' columns as one, by step; a step's newest figures win."""
    latest: dict[int, tuple[Any, ...]] = {}
    for chunk in chunks:
        cols = [chunk.get(name) or [None] * len(chunk["step"]) for name in STEP_COLUMNS]
        for row in zip(*cols, strict=True):
            latest[row[0]] = row
    rows = [latest[s] for s in sorted(latest)]
    return {name: [r[i] for r in rows] for i, name in enumerate(STEP_COLUMNS)}


def csv_rows(cols: dict[str, list[Any]], evals: Sequence[tuple[int, float | None]]
             ) -> Iterable[list[Any]]:
    """The export: a header, then one row per stored step with its validation loss where an
    evaluation ran at that step (steps with only an evaluation get a row of their own)."""
    val = dict(evals)
    yield [*STEP_COLUMNS, "val_loss"]
    steps = set(cols["step"])
    extra = sorted(s for s in val if s not in steps)
    rows = zip(*(cols[name] for name in STEP_COLUMNS), strict=True)
    pending = iter(extra)
    nxt = next(pending, None)
    for row in rows:
        while nxt is not None and nxt < row[0]:
            yield [nxt, *[None] * (len(STEP_COLUMNS) - 1), val[nxt]]
            nxt = next(pending, None)
        yield [*row, val.get(row[0])]
    while nxt is not None:
        yield [nxt, *[None] * (len(STEP_COLUMNS) - 1), val[nxt]]
        nxt = next(pending, None)


def merge_ranks(chunks: Iterable[dict[str, list[Any]]]) -> dict[int, dict[str, list[Any]]]:
    """The per-rank chunks (``RANK_STEPS``) as columns per rank, ranks in order, each by step;
    a rank's step seen twice keeps its newest figures, as ``merge_steps``."""
    latest: dict[int, dict[int, tuple[Any, ...]]] = {}
    for chunk in chunks:
        cols = [chunk.get(name) or [None] * len(chunk["step"]) for name in RANK_COLUMNS]
        for row in zip(*cols, strict=True):
            latest.setdefault(row[1], {})[row[0]] = row
    out: dict[int, dict[str, list[Any]]] = {}
    for rank in sorted(latest):
        rows = [latest[rank][s] for s in sorted(latest[rank])]
        out[rank] = {name: [r[i] for r in rows] for i, name in enumerate(RANK_COLUMNS)
                     if name != "rank"}
    return out


def straggler_table(medians: dict[int, dict[str, float | None]]) -> list[dict[str, Any]]:
    """Each rank's medians (``RANK_FIGURES``) with ``slow``: the phases in which it is the
    slowest rank by ``STRAGGLER_RATIO`` over the fastest (and ``STRAGGLER_SECONDS``)."""
    slow: dict[int, list[str]] = {rank: [] for rank in medians}
    for name in RANK_SECONDS:
        known: dict[int, float] = {rank: v for rank, m in medians.items()
                                   if (v := m[name]) is not None}
        if len(known) < 2:
            continue
        worst = max(known, key=known.__getitem__)
        high, low = known[worst], min(known.values())
        if high >= low * STRAGGLER_RATIO and high - low >= STRAGGLER_SECONDS:
            slow[worst].append(name)
    return [{"rank": rank, **m, "slow": slow[rank]} for rank, m in medians.items()]


# ---- a poll's tail: what came since the page drew, at full resolution --------------------
# A page that polls a training run asks for the steps after the last one it drew
# (``after``) and appends them, instead of the whole downsampled series every few seconds.
# The steps are those *after* it; the reports beside them (layers, ranks, comm) are those
# *from* it on: a report of the last drawn step may be stored a flush after the step was, and
# the page replaces what it holds from there.


def steps_after(cols: dict[str, list[Any]], after: int, points: int) -> dict[str, Any]:
    """The merged step columns after step ``after``, the first ``points`` of them, each
    figure ``{"y"}`` (one step per point: its min and max are itself); ``more``: some were
    left out (the page then fetches the whole series again)."""
    steps = cols["step"]
    start = _first_index(steps, after + 1)
    end = min(len(steps), start + points)
    out: dict[str, Any] = {"after": after, "points": end - start, "more": end < len(steps),
                           "step": steps[start:end], "time": cols["time"][start:end]}
    for name in STEP_COLUMNS:
        if name not in ("step", "time"):
            out[name] = {"y": cols[name][start:end]}
    return out


def layers_after(chunks: Sequence[dict[str, Any]], after: int, points: int) -> dict[str, Any]:
    """The newest layout's layer reports from step ``after`` on, one column each (at most
    ``points``), in ``layer_map``'s shape."""
    if not chunks:
        return {"layers": [], "step": [], **{c: [] for c in LAYER_COLUMNS}}
    layout = chunks[-1]["layers"]
    rows = [(s, *(c[name][i] for name in LAYER_COLUMNS))
            for c in chunks if c["layers"] == layout for i, s in enumerate(c["step"])
            if s >= after][:points]
    return {"layers": list(layout), "step": [r[0] for r in rows],
            **{name: [[r[k + 1][j] for r in rows] for j in range(len(layout))]
               for k, name in enumerate(LAYER_COLUMNS)}}


def rank_lines_after(per_rank: dict[int, dict[str, list[Any]]], after: int, points: int
                     ) -> list[dict[str, Any]]:
    """Each rank's steps from ``after`` on (at most ``points``), in ``rank_lines``' shape."""
    lines = []
    for rank, cols in per_rank.items():
        start = _first_index(cols["step"], after)
        end = min(len(cols["step"]), start + points)
        lines.append({"rank": rank, "points": end - start, "step": cols["step"][start:end],
                      **{name: cols[name][start:end] for name in RANK_FIGURES}})
    return lines


def _first_index(steps: Sequence[int], at: int) -> int:
    """The index of the first of the ascending ``steps`` that is ``at`` or later."""
    return bisect.bisect_left(steps, at)
