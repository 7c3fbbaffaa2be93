import pytest

from traind.metrics.arithmetic import (
    bucket_quantile,
    bus_bandwidth,
    nccl_size,
    window_bandwidth,
)


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


@pytest.mark.parametrize(
    ("op", "nbytes", "seconds", "world", "algbw", "busbw"),
    [
        ("all_reduce", 3_000_000, 0.003, 2, 1e9, 1e9),  # 3 calls of 1 MB in 1 ms each
        ("all_reduce", 1_000_000, 0.001, 4, 1e9, 1.5e9),  # 2*3/4
        ("all_gather", 1_000_000, 0.001, 4, 4e9, 3e9),  # the size is the output: 4 MB
        ("all_reduce", 1_000_000, 0.0, 4, 0.0, 0.0),  # nothing timed
        ("all_reduce", 0, 0.001, 4, 0.0, 0.0),
        ("all_reduce", 1_000_000, 0.001, 1, 1e9, 0.0),  # one rank: no link carries it
    ],
)
def test_window_bandwidth_is_the_mean_message_over_the_mean_call(op, nbytes, seconds, world,
                                                                  algbw, busbw):
    assert window_bandwidth(op, nbytes, seconds, world) == pytest.approx((algbw, busbw))


BOUNDS = (1.0, 2.0, 4.0)


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        (0.5, [0, 10, 0, 0], 1.5),  # all in (1, 2]: the middle of it
        (0.5, [10, 0, 0, 0], 0.5),  # the first bucket starts at 0
        (0.25, [5, 5, 0, 0], 0.5),
        (0.75, [5, 5, 0, 0], 1.5),
        (0.99, [0, 0, 10, 0], 3.98),
        (0.5, [0, 0, 0, 10], 4.0),  # in the overflow: the largest finite bound (PromQL)
        (1.0, [1, 0, 0, 0], 1.0),
        (0.0, [0, 3, 0, 0], 1.0),  # the lower edge of the first bucket with anything in it
        (0.5, [0, 0, 0, 0], None),  # nothing observed
    ],
)
def test_bucket_quantile_interpolates_as_promql_does(q, counts, expected):
    got = bucket_quantile(q, BOUNDS, counts)
    assert got == (None if expected is None else pytest.approx(expected))


def test_bucket_quantile_agrees_with_the_raw_samples_within_a_bucket():
    # 1000 evenly spread latencies in (0, 4]: the bucket estimate is exact for a uniform spread.
    samples = [4 * (i + 1) / 1000 for i in range(1000)]
    counts = [sum(1 for s in samples if lo < s <= hi)
              for lo, hi in zip((0.0, *BOUNDS), (*BOUNDS, float("inf")), strict=True)]
    for q in (0.5, 0.95, 0.99):
        assert bucket_quantile(q, BOUNDS, counts) == pytest.approx(4 * q, abs=0.01)


@pytest.mark.parametrize(("q", "counts"), [(1.5, [1, 0, 0, 0]), (0.5, [1, 0, 0])])
def test_bucket_quantile_refuses_a_bad_quantile_or_shape(q, counts):
    with pytest.raises(ValueError):
        bucket_quantile(q, BOUNDS, counts)
