"""Pure arithmetic behind derived metrics: plain numbers in, plain numbers out."""

from __future__ import annotations

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
