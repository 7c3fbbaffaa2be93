"""Topology-aware placement: which rank takes which mesh coordinate, from the link matrix.

A pure function of plain values (the matrices trainer/linkprobe.py measures, every rank the
same all-gathered copy) and the mesh shape, so every rank computes the same order with no
further communication, and the tests feed it tables of matrices.

The mesh is laid out row-major over ``("pp", "dp", "tp")`` (trainer/mesh.py): the order this
returns is the flattened mesh, ``order[slot]`` the rank at that slot. Consecutive runs of
``tp`` slots are the tp groups, runs of ``dp * tp`` the pipeline stages. So:

- the ranks are first split into ``pp`` stages of ``dp * tp`` ranks, each as closely linked
  as it can be: what is left between stages, the slowest links, carries the pipeline's one
  activation per micro-batch to a neighbour;
- each stage into tp groups of ``tp`` ranks, the fastest (tensor parallel talks in every
  layer, forward and backward); dp takes what links remain inside a stage (one gradient
  reduction per step).

Grouping is greedy (seed: the lowest rank left; then the rank whose slowest link to the group
is fastest), which finds the nodes of a cluster-shaped matrix; speeds within ``TOLERANCE`` of
the best count as ties, broken by the lowest rank, so measurement noise does not reorder a
uniform fabric. The identity order (``parallel.placement = "fixed"``) is kept unless the
grouped order is clearly better (by more than ``TOLERANCE``): a placement changes which rank
holds which shard, which a user reading per-rank series should only meet for a reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from traind.trainer.mesh import MeshShape

# The message a link's speed is judged by: a tensor-parallel activation or a gradient bucket
# is MiBs, so bandwidth dominates and latency still counts (time = latency + bytes/bandwidth).
REFERENCE_BYTES = 1 << 20
# Speeds within this factor are ties: a measured loopback varies by tens of percent between
# pairs, two links of a cluster by several times.
TOLERANCE = 1.5


def pair_speeds(latency: Sequence[Sequence[float]], bandwidth: Sequence[Sequence[float]]
                ) -> list[list[float]]:
    """Bytes per second of a :data:`REFERENCE_BYTES` message between each pair, the slower
    direction's (a collective waits for its slowest leg; an asymmetric link is as slow as its
    slow side). Symmetric; the diagonal is infinite (a rank to itself)."""
    n = len(latency)

    def one_way(i: int, j: int) -> float:
        bw = bandwidth[i][j]
        if bw <= 0 or not math.isfinite(latency[i][j]):
            return 0.0
        return REFERENCE_BYTES / (max(latency[i][j], 0.0) + REFERENCE_BYTES / bw)

    return [[math.inf if i == j else min(one_way(i, j), one_way(j, i)) for j in range(n)]
            for i in range(n)]


def _groups(members: Sequence[int], size: int, speed: list[list[float]]) -> list[list[int]]:
    """``members`` split into groups of ``size``, each greedily as fast as it can be."""
    left = sorted(members)
    groups = []
    while left:
        group = [left.pop(0)]
        while len(group) < size:
            slowest = {r: min(speed[r][m] for m in group) for r in left}
            best = max(slowest.values())
            pick = min(r for r in left if slowest[r] * TOLERANCE >= best)
            group.append(pick)
            left.remove(pick)
        groups.append(sorted(group))
    return groups


def _slowest_within(order: Sequence[int], size: int, speed: list[list[float]]) -> float:
    """The slowest link inside any run of ``size`` consecutive slots (inf: runs of one)."""
    runs = [order[i:i + size] for i in range(0, len(order), size)]
    return min((speed[a][b] for run in runs for a in run for b in run if a != b),
               default=math.inf)


def score(order: Sequence[int], shape: MeshShape, speed: list[list[float]]
          ) -> tuple[float, float]:
    """(slowest link inside a tp group, slowest inside a pipeline stage): what a layout is
    judged by, tp first."""
    return (_slowest_within(order, shape.tp, speed),
            _slowest_within(order, shape.dp * shape.tp, speed))


def _clearly_better(new: tuple[float, float], old: tuple[float, float]) -> bool:
    if new[0] > old[0] * TOLERANCE:
        return True
    return new[0] * TOLERANCE >= old[0] and new[1] > old[1] * TOLERANCE


def rank_order(latency: Sequence[Sequence[float]], bandwidth: Sequence[Sequence[float]],
               shape: MeshShape) -> list[int]:
    """The ranks in mesh-slot order (``order[slot] = rank``) for ``shape``, from the measured
    ``latency`` (seconds) and ``bandwidth`` (bytes/s) matrices, ``[src][dst]``; the identity
    unless grouping is clearly faster (module docstring)."""
    n = len(latency)
    if n != shape.world or len(bandwidth) != n:
        raise ValueError(f"a {n}-rank link matrix for a mesh of {shape.world} ranks")
    identity = list(range(n))
    speed = pair_speeds(latency, bandwidth)
    stages = _groups(identity, shape.dp * shape.tp, speed) if shape.pp > 1 else [identity]
    grouped = [r for stage in stages for group in _groups(stage, shape.tp, speed)
               for r in group]
    better = _clearly_better(score(grouped, shape, speed), score(identity, shape, speed))
    return grouped if better else identity

