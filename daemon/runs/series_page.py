"""What ``/api/runs/{id}/series`` answers, put together from a run's stored parts. Pure.

One function for the daemon's facade and the web tests' fake service alike, so the shape the
page reads has one definition. Whole (``after`` None): every line folded to ``points`` as its
chunks stream by, newest first (``daemon/runs/series_fold.py``: memory bounded by the points,
not the run). A poll's tail (``after`` a step): the steps after it and the reports from it on
at full resolution (``daemon/runs/series.py``), with ``"after"`` set so the page appends them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traind.daemon.ingest.series import COMM, LAYERS, RANK_STEPS, STEPS
from traind.daemon.runs import comm_series, series, series_fold

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

def series_page(run_id: int, chunks: Callable[[str, bool], Iterable[dict[str, Any]]],
                first_step: Callable[[str], int | None], *,
                evals: Sequence[tuple[int, float | None]],
                precision: Sequence[dict[str, Any]], points: int, ranks: bool = False,
                comm: bool = False, after: int | None = None) -> dict[str, Any]:
    """The run's series for its page. ``chunks(kind, newest_first)``: a kind's stored
    chunks, newest first for a whole page (all of them, best streamed), oldest first for a
    tail (those that may hold a step from ``after`` on); ``first_step(kind)``: the kind's
    first stored step
    (None: nothing stored); ``ranks`` / ``comm``: also ``"ranks"`` / ``"comm"``; ``evals``
    (step, validation loss) and ``precision`` (switches with their ``step``) oldest
    first."""
    since = -1 if after is None else after  # a tail's reports: from ``after`` on
    out: dict[str, Any] = {"run": run_id}
    if after is None:
        out.update(series_fold.steps_page(chunks(STEPS, True), first_step(STEPS) or 0, points))
        out["layers"] = series_fold.layers_page(chunks(LAYERS, True), first_step(LAYERS) or 0)
    else:
        out.update(series.steps_after(series.merge_steps(chunks(STEPS, False)), after, points))
        out["layers"] = series.layers_after(list(chunks(LAYERS, False)), after, points)
    out["evals"] = {"step": [s for s, _ in evals if s >= since],
                    "val_loss": [v for s, v in evals if s >= since]}
    out["precision"] = [p for p in precision if p["step"] >= since]
    if ranks:
        if after is None:
            out["ranks"] = series_fold.ranks_page(chunks(RANK_STEPS, True),
                                                  first_step(RANK_STEPS) or 0, points)
        else:  # a tail leaves the medians out: they are of every stored step
            merged = series.merge_ranks(chunks(RANK_STEPS, False))
            out["ranks"] = {"lines": series.rank_lines_after(merged, after, points)}
    if comm:
        out["comm"] = (series_fold.comm_page(chunks(COMM, True), first_step(COMM) or 0, points)
                       if after is None else comm_series.comm_lines(
                           *comm_series.merge_comm(chunks(COMM, False)), points, after))
    return out
