"""Bucket bounds of the communication figures: a rank bins what it measured with them before it
reports (trainer/collectives.py), and the Prometheus histograms are declared with the same ones
(metrics/catalog.py), so a bucket means the same on both sides of the worker boundary."""

from __future__ import annotations

import bisect

KIB, MIB = 2**10, 2**20
# Message-size buckets (upper bounds, bytes): the probe's range, 4 KiB to 64 MiB, by 16x.
SIZE_BOUNDS = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB)
SIZE_LABELS = ("4KiB", "64KiB", "1MiB", "16MiB", "64MiB", "inf")
# Latency bounds (seconds): a gloo all-reduce of 4 KiB over loopback is ~50 us, a 64 MiB one
# across a slow link is seconds; NVLink brings small messages under 10 us.
LATENCY_BOUNDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def size_bucket(nbytes: int) -> str:
    """The label of the smallest size bucket that holds a message of ``nbytes``."""
    return SIZE_LABELS[bisect.bisect_left(SIZE_BOUNDS, nbytes)]


def latency_bin(seconds: float) -> int:
    """Index of the latency bucket for ``seconds`` (le semantics; the last is +Inf)."""
    return bisect.bisect_left(LATENCY_BOUNDS, seconds)
