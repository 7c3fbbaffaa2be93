import pytest

from traind.metrics.arithmetic import bus_bandwidth


@pytest.mark.parametrize(
    ("size", "seconds", "world", "op", "expected"),
    [
        (1_000_000, 0.001, 2, "all_reduce", 1e9),  # 2(n-1)/n = 1 at two ranks
        (1_000_000, 0.001, 8, "all_reduce", 1.75e9),  # 2*7/8
        (1_000_000, 0.001, 8, "all_gather", 0.875e9),  # 7/8
        (1_000_000, 0.001, 4, "reduce_scatter", 0.75e9),
        (1_000_000, 0.0, 8, "all_reduce", 0.0),
        (1_000_000, 0.001, 1, "all_reduce", 0.0),  # one rank moves nothing
    ],
)
def test_bus_bandwidth_uses_nccl_tests_factors(size, seconds, world, op, expected):
    assert bus_bandwidth(size, seconds, world, op) == pytest.approx(expected)
