"""Placement from a link matrix (trainer/placement.py), with tables of matrices; and the
round-robin schedule the probe meets its pairs in (trainer/linkprobe.py)."""

from __future__ import annotations

import itertools

import pytest

from traind.trainer.linkprobe import rounds
from traind.trainer.mesh import MeshShape
from traind.trainer.placement import pair_speeds, rank_order

FAST, SLOW = 10e9, 0.1e9  # bytes/s: NVLink-ish inside a node, a slow network between
LAT_FAST, LAT_SLOW = 5e-6, 50e-6


def matrix(n: int, link: dict[tuple[int, int], tuple[float, float]] | None = None,
           nodes: list[set[int]] | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """(latency, bandwidth): every pair fast, pairs across ``nodes`` slow, ``link`` sets
    single directed links (src, dst) -> (latency, bandwidth)."""
    def node(r: int) -> int:
        return next((i for i, ns in enumerate(nodes or []) if r in ns), 0)

    lat = [[0.0 if i == j else LAT_FAST if node(i) == node(j) else LAT_SLOW
            for j in range(n)] for i in range(n)]
    bw = [[0.0 if i == j else FAST if node(i) == node(j) else SLOW for j in range(n)]
          for i in range(n)]
    for (i, j), (la, b) in (link or {}).items():
        lat[i][j], bw[i][j] = la, b
    return lat, bw


def groups(order: list[int], size: int) -> list[set[int]]:
    return [set(order[i:i + size]) for i in range(0, len(order), size)]


CASES = [
    # (what, world, shape, matrix kwargs, expected order)
    ("uniform: the fixed layout", 4, MeshShape(dp=2, tp=2), {}, [0, 1, 2, 3]),
    ("uniform, 8 ranks, 3D", 8, MeshShape(dp=2, tp=2, pp=2), {}, list(range(8))),
    ("two nodes numbered node by node: already right", 4, MeshShape(dp=2, tp=2),
     {"nodes": [{0, 1}, {2, 3}]}, [0, 1, 2, 3]),
    ("two nodes interleaved (0, 2 | 1, 3): tp inside each node", 4, MeshShape(dp=2, tp=2),
     {"nodes": [{0, 2}, {1, 3}]}, [0, 2, 1, 3]),
    ("one slow pair (0, 1): tp avoids it", 4, MeshShape(dp=2, tp=2),
     {"link": {(0, 1): (LAT_SLOW, SLOW), (1, 0): (LAT_SLOW, SLOW)}}, [0, 2, 1, 3]),
    ("an asymmetric link: slow 1 -> 0 only, still avoided", 4, MeshShape(dp=2, tp=2),
     {"link": {(1, 0): (LAT_FAST, SLOW)}}, [0, 2, 1, 3]),
    ("a high-latency pair (0, 1) at full bandwidth is slower", 4, MeshShape(dp=2, tp=2),
     {"link": {(0, 1): (5e-3, FAST), (1, 0): (5e-3, FAST)}}, [0, 2, 1, 3]),
    ("pp across the slow link, tp inside the nodes", 4, MeshShape(dp=1, tp=2, pp=2),
     {"nodes": [{0, 3}, {1, 2}]}, [0, 3, 1, 2]),
    ("dp2 x pp2: the stages are the nodes (dp talks more than pp)", 4,
     MeshShape(dp=2, tp=1, pp=2), {"nodes": [{0, 2}, {1, 3}]}, [0, 2, 1, 3]),
    ("dp only, two nodes: nothing to gain, fixed", 4, MeshShape(dp=4, tp=1),
     {"nodes": [{0, 2}, {1, 3}]}, [0, 1, 2, 3]),
]


@pytest.mark.parametrize(("world", "shape", "kw", "want"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rank_order(world: int, shape: MeshShape, kw: dict, want: list[int]) -> None:
    lat, bw = matrix(world, **kw)
    assert rank_order(lat, bw, shape) == want


def test_two_nodes_of_four_three_dimensions_keep_tp_and_dp_inside_a_node() -> None:
    nodes = [{0, 2, 4, 6}, {1, 3, 5, 7}]  # a scrambled numbering of two 4-rank nodes
    lat, bw = matrix(8, nodes=nodes)
    order = rank_order(lat, bw, MeshShape(dp=2, tp=2, pp=2))
    assert sorted(order) == list(range(8))
    assert all(any(g <= n for n in nodes) for g in groups(order, 2))  # tp pairs
    assert all(any(g <= n for n in nodes) for g in groups(order, 4))  # stages: pp across


def test_measurement_noise_on_a_uniform_fabric_keeps_the_fixed_order() -> None:
    # loopback gloo measured here varies ~20% between pairs: not a reason to relabel ranks
    lat, bw = matrix(4)
    for (i, j), f in zip(itertools.permutations(range(4), 2),
                         [1.2, 0.85, 1.1, 0.9, 1.25, 0.8, 1.0, 1.15, 0.95, 0.82, 1.3, 1.05],
                         strict=True):
        bw[i][j] *= f
    assert rank_order(lat, bw, MeshShape(dp=2, tp=2)) == [0, 1, 2, 3]


def test_pair_speed_is_the_slower_direction_and_symmetric() -> None:
    lat, bw = matrix(2, link={(1, 0): (LAT_FAST, SLOW)})
    s = pair_speeds(lat, bw)
    assert s[0][1] == s[1][0] < SLOW


def test_a_matrix_of_another_size_is_refused() -> None:
    lat, bw = matrix(2)
    with pytest.raises(ValueError, match="2-rank link matrix for a mesh of 4"):
        rank_order(lat, bw, MeshShape(dp=2, tp=2))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_rounds_meet_every_pair_once_and_keep_every_rank_busy(n: int) -> None:
    schedule = rounds(n)
    assert len(schedule) == (n - 1 if n % 2 == 0 else n)
    met = [pair for r in schedule for pair in r]
    assert sorted(met) == list(itertools.combinations(range(n), 2))  # each pair once
    for r in schedule:
        busy = [rank for pair in r for rank in pair]
        assert len(busy) == len(set(busy)) == n - n % 2  # one partner each (a bye if odd)
