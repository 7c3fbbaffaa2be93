"""What ``/api/runs/{id}/series`` answers, put together from a run's stored parts. Pure.

One function for the daemon's facade and the web tests' fake service alike, so the shape the
page reads has one definition. Whole (``after`` None): every line downsampled to ``points``.
A poll's tail (``after`` a step): the steps after it and the reports from it on at full
resolution (``daemon/runs/series.py``), with ``"after"`` set so the page appends them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traind.daemon.runs import comm_series, series

if TYPE_CHECKING:
    from collections.abc import Sequence


def series_page(run_id: int, steps: dict[str, list[Any]], *,
                evals: Sequence[tuple[int, float | None]],
                precision: Sequence[dict[str, Any]], layer_chunks: Sequence[dict[str, Any]],
                points: int, rank_chunks: Sequence[dict[str, Any]] | None = None,
                comm_chunks: Sequence[dict[str, Any]] | None = None,
                after: int | None = None) -> dict[str, Any]:
    """The run's series for its page. ``rank_chunks`` / ``comm_chunks``: None when not
    asked for (no ``"ranks"`` / ``"comm"``); ``evals`` (step, validation loss) and
    ``precision`` (switches with their ``step``) oldest first."""
    since = -1 if after is None else after  # a tail's reports: from ``after`` on
    out: dict[str, Any] = {
        "run": run_id,
        **(series.downsample(steps, points) if after is None
           else series.steps_after(steps, after, points)),
        "evals": {"step": [s for s, _ in evals if s >= since],
                  "val_loss": [v for s, v in evals if s >= since]},
        "layers": (series.layer_map(layer_chunks) if after is None
                   else series.layers_after(layer_chunks, after, points)),
        "precision": [p for p in precision if p["step"] >= since],
    }
    if rank_chunks is not None:
        merged = series.merge_ranks(rank_chunks)
        # A tail leaves the medians out: they are of every stored step, which a tail is not.
        out["ranks"] = ({"lines": series.rank_lines(merged, points),
                         "table": series.rank_table(merged)} if after is None
                        else {"lines": series.rank_lines_after(merged, after, points)})
    if comm_chunks is not None:
        out["comm"] = comm_series.comm_lines(*comm_series.merge_comm(comm_chunks), points,
                                             after)
    return out
