"""Pure arithmetic behind derived metrics: plain numbers in, plain numbers out."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

# nccl-tests' bus-bandwidth factors: what each link carries relative to the message size,
# so a number is comparable across world sizes (PERFORMANCE.md in nccl-tests).
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # int8/topk's first phase
}


def nccl_size(op: str, message_bytes: int, world_size: int) -> int:
    """nccl-tests' size S of a collective from the bytes one rank handed it: an all-gather's S
    is its output, ``world_size`` x each rank's part; every other op's is its input."""
    return message_bytes * (world_size if op == "all_gather" else 1)


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int,
                  op: str = "all_reduce") -> float:
    """Bus bandwidth in bytes/s of one collective of nccl-tests size ``size_bytes`` (see
    :func:`nccl_size`) that took ``seconds``."""
    if seconds <= 0 or world_size < 2:
        return 0.0
    return size_bytes / seconds * BUS_FACTORS[op](world_size)


def window_bandwidth(op: str, message_bytes: int, seconds: float, world_size: int
                     ) -> tuple[float, float]:
    """Algorithm and bus bandwidth (bytes/s) of a window of ``op`` calls in which one rank
    handed the collectives ``message_bytes`` in all and waited ``seconds`` in all: the mean
    message over the mean call time (which the call count cancels out of). The exported
    gauges and a run page's communication lines are both this. (0, 0) for an empty window."""
    if seconds <= 0 or message_bytes <= 0:
        return 0.0, 0.0
    size = nccl_size(op, message_bytes, world_size)
    return size / seconds, bus_bandwidth(size, seconds, world_size, op)


def bucket_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The ``q``-quantile (0..1) of observations binned by upper ``bounds``: ``counts`` has
    one entry per bound plus the +Inf overflow, not cumulative. PromQL's
    ``histogram_quantile``, so a page and a Grafana panel of the same histogram agree:
    linear inside the bucket the rank falls in (the first bucket starts at 0), and the
    largest finite bound for a rank in the overflow. None when nothing was observed."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is outside 0..1")
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"{len(counts)} counts for {len(bounds)} bounds and +Inf")
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for bound, n in zip(bounds, counts, strict=False):
        if n and seen + n >= rank:
            return lower + (bound - lower) * max(0.0, rank - seen) / n
        seen, lower = seen + n, bound
    return float(bounds[-1]) if bounds else None
