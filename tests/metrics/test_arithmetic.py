import pytest

from traind.metrics.arithmetic import bus_bandwidth, nccl_size


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


@pytest.mark.parametrize(("op", "expected"), [
    ("all_gather", 8000),  # the output: 8 ranks x 1000
    ("all_reduce", 1000), ("all_to_all", 1000), ("reduce_scatter", 1000),
])
def test_nccl_size_is_the_all_gathers_output(op: str, expected: int) -> None:
    assert nccl_size(op, 1000, 8) == expected
