"""The pure formatting behind the templates, and samples-to-rows for the hardware and
communication pages, as tables of cases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from traind.contracts.states import EXPERIMENT_STATES, RUN_STATES
from traind.daemon.service import MetricSample, RunView
from traind.web.nodeviews import (
    Meter,
    Samples,
    comm_view,
    family_of,
    gpu_card,
    hardware_view,
    host_view,
    throttle_label,
)
from traind.web.views import (
    DASH,
    bar_percent,
    cpu_warnings,
    current_run,
    fmt_bytes,
    fmt_celsius,
    fmt_count,
    fmt_duration,
    fmt_factor,
    fmt_hertz,
    fmt_number,
    fmt_percent,
    fmt_rate,
    fmt_seconds,
    fmt_size,
    fmt_watts,
    run_row,
    run_seconds,
)

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def view(id: int = 1, state: str = "running", **kw: object) -> RunView:
    fields: dict = {
        "name": f"run-{id}",
        "created_at": T0,
        "started_at": None,
        "finished_at": None,
        "exit_code": None,
        "error": None,
        "summary": {},
    }
    fields.update(kw)
    return RunView(id=id, state=state, **fields)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, DASH),
        (-1, DASH),
        (float("nan"), DASH),
        (0, "0s"),
        (59.9, "59s"),
        (60, "1m 00s"),
        (187, "3m 07s"),
        (3600, "1h 00m"),
        (7500, "2h 05m"),
        (86400 * 3 + 3600 * 4 + 5, "3d 4h"),
    ],
)
def test_fmt_duration(seconds: float | None, text: str) -> None:
    assert fmt_duration(seconds) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, DASH),
        ("3.2", DASH),
        (True, DASH),
        (3.21, "3.2100"),
        (0, "0.0000"),
        (2, "2.0000"),
        (1e-5, "1.000e-05"),
        (2.5e7, "2.500e+07"),
        (float("nan"), "nan"),
    ],
)
def test_fmt_number(value: object, text: str) -> None:
    assert fmt_number(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, DASH), (1200, "1,200"), (51234.5, "51,234"), (0.4, "0"), (float("inf"), "inf")],
)
def test_fmt_count(value: object, text: str) -> None:
    assert fmt_count(value) == text


def test_run_seconds_counts_a_running_run_up_to_now_and_accepts_naive_times() -> None:
    naive_start = (T0 - timedelta(minutes=5)).replace(tzinfo=None)  # SQLite hands these back
    assert run_seconds(view(started_at=naive_start), T0) == 300
    done = view(started_at=T0, finished_at=T0 + timedelta(seconds=42))
    assert run_seconds(done, T0 + timedelta(days=9)) == 42
    assert run_seconds(view(state="queued"), T0) is None


def test_run_row_shows_the_error_of_failed_runs_only() -> None:
    assert run_row(view(state="failed", error="boom", exit_code=1), T0).error == "boom"
    assert run_row(view(state="stopped", error="boom", exit_code=-15), T0).error is None
    row = run_row(view(state="weird", summary={"step": 10, "tokens_per_second": 1e4}), T0)
    assert (row.state, row.step, row.tokens_per_second, row.exit_code) == (
        "unknown",
        "10",
        "10,000",
        DASH,
    )


@pytest.mark.parametrize(
    ("states", "live", "expected"),
    [
        ([], None, None),
        (["queued", "completed"], None, 1),  # newest
        (["queued", "running", "completed"], None, 2),  # a running one
        # ... even when another run has the newest live points: it does not jump
        (["queued", "running", "completed"], 3, 2),
        (["running", "running", "completed"], 1, 2),  # the longest-training (oldest) one
        (["completed", "completed"], 2, 2),  # none training: the one with live points
        (["queued", "running"], 99, 2),  # live points of a run not listed
    ],
)
def test_current_run(states: list[str], live: int | None, expected: int | None) -> None:
    runs = [view(id=i + 1, state=s) for i, s in enumerate(states)]  # newest first
    run = current_run(runs, live)
    assert (run.id if run else None) == expected
    if runs:  # a run chosen (?run=) wins; one not listed does not count
        assert current_run(runs, live, chosen=runs[-1].id) == runs[-1]
        assert current_run(runs, live, chosen=99) == run


GiB = 2**30


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, DASH),
        ("1", DASH),
        (float("nan"), DASH),
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (420 * 2**20, "420.0 MiB"),
        (79.6 * GiB, "79.6 GiB"),
        (1.9e12, "1.7 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_fmt_bytes(value: object, text: str) -> None:
    assert fmt_bytes(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, DASH), (4, "4 B"), (4096, "4 KiB"), (2**26, "64 MiB"), (1.5 * 2**20, "1.5 MiB")],
)
def test_fmt_size(value: object, text: str) -> None:
    assert fmt_size(value) == text


@pytest.mark.parametrize(("value", "text"), [(None, DASH), (0, "0 B/s"), (1.3 * GiB, "1.3 GiB/s")])
def test_fmt_rate(value: object, text: str) -> None:
    assert fmt_rate(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, DASH),
        (0, "0%"),
        (1, "100%"),
        (0.634, "63%"),
        (0.075, "7.5%"),
        (0.01, "1.0%"),
        (0.00034, "0.034%"),
        (1.5, "150%"),
    ],
)
def test_fmt_percent(value: object, text: str) -> None:
    assert fmt_percent(value) == text


@pytest.mark.parametrize(
    ("fmt", "value", "text"),
    [
        (fmt_hertz, 1.98e9, "1,980 MHz"),
        (fmt_hertz, 210e6, "210 MHz"),
        (fmt_hertz, None, DASH),
        (fmt_watts, 699.6, "700 W"),
        (fmt_watts, float("inf"), DASH),
        (fmt_celsius, 64.4, "64 \u00b0C"),
        (fmt_factor, 64.44, "64.4\u00d7"),
        (fmt_factor, 1, "1.0\u00d7"),
    ],
)
def test_unit_formatters(fmt: Any, value: object, text: str) -> None:
    assert fmt(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, DASH),
        (-1, DASH),
        (0, "0 s"),
        (20.5e-6, "20.5 \u00b5s"),
        (4.2e-3, "4.2 ms"),
        (0.25, "250 ms"),
        (18.624, "18.62 s"),
        (312.5, "5m 12s"),
    ],
)
def test_fmt_seconds(seconds: object, text: str) -> None:
    assert fmt_seconds(seconds) == text


@pytest.mark.parametrize(
    ("part", "whole", "pct"),
    [
        (0.5, 1.0, 50.0),
        (3, 4, 75.0),
        (5, 4, 100.0),  # clamped
        (-1, 4, 0.0),
        (1, 0, None),  # nothing to be a share of
        (None, 4, None),
        (1, None, None),
    ],
)
def test_bar_percent(part: object, whole: object, pct: float | None) -> None:
    assert bar_percent(part, whole) == pct


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("traind_gpu_power_watts", "traind_gpu_power_watts"),
        ("traind_comm_sent_bytes_total", "traind_comm_sent_bytes"),
        ("traind_step_duration_seconds_bucket", "traind_step_duration_seconds"),
        ("traind_step_duration_seconds_count", "traind_step_duration_seconds"),
        ("traind_build_info", "traind_build"),
        ("traind_gpu_info", "traind_gpu_info"),  # a gauge named _info: itself, not stripped
        ("traind_unknown_total", None),
    ],
)
def test_family_of(name: str, family: str | None) -> None:
    spec = family_of(name)
    assert (spec.name if spec else None) == family


def test_throttle_label() -> None:
    assert throttle_label("sw_power_cap") == "SW power cap"
    assert throttle_label("hw_thermal_slowdown") == "HW thermal slowdown"
    assert throttle_label("gpu_idle") == "GPU idle"


def s(name: str, value: float, **labels: str) -> MetricSample:
    return MetricSample(name, labels, value)


def test_gpu_card_sums_links_flags_a_downtrained_link_and_skips_idle_as_a_warning() -> None:
    g = {"gpu": "3"}
    card = gpu_card(
        Samples(
            [
                s("traind_gpu_memory_used_bytes", 78 * GiB, **g),
                s("traind_gpu_memory_total_bytes", 80 * GiB, **g),
                s("traind_gpu_pcie_link_generation", 3, **g),
                s("traind_gpu_pcie_link_width", 8, **g),
                s("traind_gpu_pcie_link_max_generation", 5, **g),
                s("traind_gpu_pcie_link_max_width", 16, **g),
                s("traind_gpu_nvlink_active_links", 1, link="0", **g),
                s("traind_gpu_nvlink_active_links", 0, link="1", **g),
                s("traind_gpu_nvlink_active_links", 1, link="2", **g),
                s("traind_gpu_throttle_reason", 1, reason="gpu_idle", **g),
                s("traind_gpu_throttle_reason", 1, reason="hw_slowdown", **g),
                s("traind_gpu_throttle_reason", 0, reason="sw_power_cap", **g),
                s("traind_gpu_utilization_ratio", 0.5, gpu="4"),  # another GPU's
            ]
        ),
        "3",
    )
    assert card.memory.text == "78.0 GiB / 80.0 GiB" and card.memory.warn
    assert card.pcie == "Gen 3 \u00d78 (max Gen 5 \u00d716)"
    assert card.nvlink == "2 up"
    assert [(b.text, b.warn) for b in card.throttles] == [
        ("GPU idle", False),
        ("HW slowdown", True),
    ]
    # Nothing reported: dashes and no bars, never a crash.
    assert card.utilization == Meter(DASH) and card.power == Meter(DASH)
    assert (card.sm_clock, card.pcie_tx, card.temperatures) == (DASH, DASH, ())


@pytest.mark.parametrize(
    ("samples", "count", "gpus"),
    [
        ([], 0, ()),
        ([s("traind_gpu_devices", 0)], 0, ()),
        # GPU info orders the cards numerically: 10 after 2.
        (
            [
                s("traind_gpu_devices", 2),
                s("traind_gpu_info", 1, gpu="10"),
                s("traind_gpu_info", 1, gpu="2"),
            ],
            2,
            ("2", "10"),
        ),
    ],
)
def test_hardware_view_gpu_presence(
    samples: list[MetricSample], count: int, gpus: tuple[str, ...]
) -> None:
    hw = hardware_view(samples)
    assert hw.gpu_count == count and tuple(g.index for g in hw.gpus) == gpus
    assert not hw.gpu_collector_failed


def test_host_view_without_swap_and_partial_load() -> None:
    host = host_view(
        Samples(
            [
                s("traind_host_swap_total_bytes", 0),
                s("traind_host_swap_used_bytes", 0),
                s("traind_host_load", 1.5, window="1m"),
                s("traind_host_cpu_usage_ratio", 1.0),
            ]
        )
    )
    assert host.swap == Meter("none")
    assert host.load == f"1.50 \u00b7 {DASH} \u00b7 {DASH}"
    assert host.cpu == Meter("100%", 100.0, False)  # a busy CPU is no warning
    assert host.memory == Meter(f"{DASH}")


def comm(run: str, rank: str, wait: float, method: str = "none") -> list[MetricSample]:
    lab = {"run": run, "rank": rank, "method": method}
    return [
        s("traind_comm_gradient_bytes_total", 1024, **lab),
        s("traind_comm_allreduce_seconds_total", wait, **lab),
    ]


def test_comm_view_shows_the_newest_run_and_marks_the_least_wait() -> None:
    view = comm_view(
        [
            *comm("9", "0", 5.0),
            *comm("9", "1", 2.0),
            *comm("10", "0", 3.0),
            *comm("10", "1", 1.0),
            *comm("10", "2", 3.0),
        ]
    )
    assert view.run == "10"  # numerically newest, not "9" > "10" as strings
    assert [(r.rank, r.least_wait) for r in view.rows] == [("0", False), ("1", True), ("2", False)]
    assert view.rows[1].allreduce == "1.00 s" and view.rows[0].raw == "1.0 KiB"


@pytest.mark.parametrize(
    "samples",
    [
        [],
        comm("1", "0", 2.0),  # one rank: nobody to compare with
        [*comm("1", "0", 2.0), *comm("1", "1", 2.0)],  # equal waits: no straggler
    ],
)
def test_comm_view_marks_nobody_without_a_difference(samples: list[MetricSample]) -> None:
    view = comm_view(samples)
    assert not any(r.least_wait for r in view.rows)
    assert view.empty is (samples == [])


def test_comm_view_probe_tables_and_chart() -> None:
    def probe(rank: str, size: int, seconds: float) -> list[MetricSample]:
        lab = {"run": "2", "rank": rank, "op": "all_reduce", "size_bytes": str(size)}
        return [
            s("traind_comm_probe_latency_seconds", seconds, **lab),
            s("traind_comm_probe_bus_bandwidth_bytes_per_second", size / seconds, **lab),
        ]

    view = comm_view([*probe("0", 2**20, 1e-3), *probe("0", 4096, 2e-5), *probe("1", 4096, 3e-5)])
    assert not view.empty and view.rows == ()
    (table,) = view.probes
    assert table.op == "all_reduce" and table.ranks == ("0", "1")
    # Sizes in numeric order; a rank without that size shows dashes.
    assert table.rows == (
        ("4 KiB", (("20 \u00b5s", "195.3 MiB/s"), ("30 \u00b5s", "130.2 MiB/s"))),
        ("1 MiB", (("1 ms", "1000.0 MiB/s"), (DASH, DASH))),
    )
    assert [t["name"] for t in view.chart] == ["all_reduce rank 0", "all_reduce rank 1"]
    assert view.chart[0]["x"] == [4096.0, 2.0**20] and view.chart[0]["text"] == ["4 KiB", "1 MiB"]
    assert view.chart[0]["y"][1] == pytest.approx(2**20 / 1e-3 / 2**30)


def test_run_row_carries_ab_verdicts():
    from datetime import UTC, datetime

    from traind.daemon.service import RunView
    from traind.web.views import run_row

    now = datetime.now(UTC)
    run = RunView(id=1, name="ab", state="completed", created_at=now, started_at=now,
                  finished_at=now, exit_code=0, error=None,
                  summary={"ab": {"int8": {"kind": "better", "reason": "int8 is 1.2x faster"}}})
    assert run_row(run, now).ab == (("int8", "better", "int8 is 1.2x faster"),)


def test_every_state_a_run_can_end_in_has_its_badge() -> None:
    # The pages kept their own copy of the run states, without "preempted": a run the daemon
    # checkpointed on its way down showed as "unknown". One list now (contracts/states.py).
    assert run_row(view(state="preempted"), T0).state == "preempted"
    assert {"completed", "failed", "stopped", "preempted", "running", "queued"} == set(
        RUN_STATES)


def test_the_scheduler_collector_reports_every_experiment_state() -> None:
    from traind.metrics.scheduler import SchedulerCollector

    fams = list(SchedulerCollector(lambda: {}, lambda: {}).collect())
    states = {s.labels["state"] for f in fams if f.name == "traind_experiments"
              for s in f.samples}
    assert states == set(EXPERIMENT_STATES)


def _exp(i: int, *, state: str = "done", mode: str = "interleaved",
         noise: Any = 0.04, pairs: int = 30) -> Any:
    from traind.daemon.service import ExperimentInfo

    verdict = None if noise is None else {"b": {"kind": "no difference", "noise": noise,
                                                "pairs": pairs}}
    return ExperimentInfo(id=i, name="e", state=state, mode=mode, arms=("a", "b"), run_id=1,
                          verdict=verdict, config_hash="0", versions={},
                          created_at=datetime(2026, 1, 1, tzinfo=UTC), finished_at=None)


@pytest.mark.parametrize(("infos", "band", "block_steps", "want"), [
    # the newest done interleaved experiment with a noise, newest first
    ([_exp(3, state="running"), _exp(2, mode="forked"), _exp(1)], 0.02, 20,
     "at this node's noise (4% per pair, measured over 30 pairs by experiment 1) \u00b12% needs "
     "about 45 pairs (1,800 steps)"),
    ([_exp(2, noise=None), _exp(1, noise=0.01)], 0.015, 10,
     "at this node's noise (1% per pair, measured over 30 pairs by experiment 1) \u00b11.5% "
     "needs about 10 pairs (200 steps)"),
    ([_exp(1, noise=0.5)], 0.001, 20,
     "at this node's noise (50% per pair, measured over 30 pairs by experiment 1) \u00b10.1% is "
     "out of reach: widen the band"),
    ([_exp(2, noise=None), _exp(1, noise=float("nan"))], 0.02, 20, None),  # nothing measured
    ([], 0.02, 20, None),
    ([_exp(1)], 0.0, 20, None),  # not a band (yet): nothing to say
    # pooled over the newest experiments, by their pairs (bands.measured_noise)
    ([_exp(2, noise=0.02, pairs=10), _exp(1, noise=0.01, pairs=30)], 0.015, 10,
     "at this node's noise (1.3% per pair, measured over 40 pairs by 2 experiments, the newest "
     "2) \u00b11.5% needs about 13 pairs (260 steps)"),
])
def test_band_cost_reads_the_newest_measured_noise(infos: list[Any], band: float,
                                                   block_steps: int, want: str | None) -> None:
    from traind.daemon.experiments.stats import pairs_to_equivalence
    from traind.web.views import band_cost

    got = band_cost(infos, band=band, block_steps=block_steps)
    assert got == want
    if want is not None and "needs" in want and "by experiment" in want:  # stats' figure
        pairs = pairs_to_equivalence(0.04 if "4%" in want else 0.01, band)
        assert f"about {pairs} pairs" in want


@pytest.mark.parametrize(("record", "want"), [
    ({"kind": "better", "decided_at_step": 60, "budget_steps": 4000}, "step 60 of 4,000"),
    ({"kind": "better", "decided_at_step": 60}, "step 60"),
    ({"kind": "running", "budget_steps": 400}, ""),
    (None, ""),
])
def test_decided_label(record: Any, want: str) -> None:
    from traind.web.views import decided_label

    assert decided_label(record) == want


@pytest.mark.parametrize(("summary", "expected"), [
    ({}, ()),  # a summary from before the fields existed
    ({"ranks_per_node": 2, "threads": 1, "usable_cpus": 2}, ()),  # fits exactly
    ({"ranks_per_node": 2, "threads": 2, "usable_cpus": 2},
     ("2 ranks \u00d7 2 threads on 2 usable CPUs: threads wait for a CPU (job.threads=1, or "
      "0 for the default, fits)",)),
    ({"ranks_per_node": 1, "threads": 4, "usable_cpus": 1},
     ("1 rank \u00d7 4 threads on 1 usable CPU: threads wait for a CPU (job.threads=1, or 0 "
      "for the default, fits)",)),
    # the host's checks: a few, and most of them, or nothing is said
    ({"usable_cpus": 2, "host_checks": 4, "host_oversubscribed": 4}, ()),
    ({"usable_cpus": 2, "host_checks": 10, "host_oversubscribed": 4}, ()),
    ({"usable_cpus": 2, "host_checks": 10, "host_oversubscribed": 5},
     ("the host had more runnable threads than its 2 usable CPUs in 5 of 10 checks while this "
      "run trained: outside load slowed it, and its tokens/s are not those of a quiet node",)),
    ({"ranks_per_node": "2", "threads": None, "host_checks": True}, ()),  # junk is no warning
])
def test_cpu_warnings(summary: dict[str, Any], expected: tuple[str, ...]) -> None:
    assert cpu_warnings(summary) == expected


def test_run_row_carries_both_cpu_warnings() -> None:
    row = run_row(view(summary={"ranks_per_node": 2, "threads": 2, "usable_cpus": 2,
                                "host_checks": 6, "host_oversubscribed": 6}), T0)
    assert len(row.warnings) == 2 and row.warnings[1].startswith("the host had")


@pytest.mark.parametrize(("state", "kind", "shown"), [
    ("cancelled", "running", "cancelled"), ("failed", "pending", "failed"),
    ("running", "running", "running"), ("cancelled", "better", "better"),
])
def test_an_ended_experiments_undecided_arm_says_how_it_ended(state: str, kind: str,
                                                              shown: str) -> None:
    from traind.daemon.service import ExperimentInfo
    from traind.web.views import experiment_row, verdict_rows

    v = {"kind": kind, "ratio": 1.264, "low": 0.9, "high": 1.7, "p_value": 0.2,
         "reason": "int8: 1.264x so far (6 pairs, always-valid p 0.2)"}
    info = ExperimentInfo(id=1, name="e", state=state, mode="interleaved",
                          arms=("none", "int8"), run_id=3, verdict={"int8": v},
                          config_hash="h", versions={}, created_at=datetime.now(UTC),
                          finished_at=None)
    (row,) = verdict_rows(info)
    assert row["kind"] == shown
    if shown != kind:
        assert row["reason"] == (f"the experiment was {state} before int8 was decided; when "
                                 "it stopped: int8: 1.264x so far (6 pairs, always-valid p 0.2)")
        assert experiment_row(info).verdicts[0].badge == ("cancelled" if state == "cancelled"
                                                          else "failed")
    else:
        assert row["reason"] == v["reason"]


def test_goodput_view_names_every_bucket_and_splits_the_wall_time() -> None:
    from traind.metrics.goodput import BADPUT
    from traind.web.runviews import GOODPUT_LABELS, goodput_view

    assert set(GOODPUT_LABELS) == {"productive", *BADPUT}  # no bucket left unnamed
    assert goodput_view(None) is None and goodput_view({"wall": "x"}) is None
    view = goodput_view({"wall": 100.0, "productive": 80.0, "ratio": 0.8, "ettr": 0.9,
                         "attempts": 2, "badput": {"startup": 5.0, "progress_lost": 15.0,
                                                   "evaluation": 0.0}})
    assert view is not None and (view.ratio, view.ettr, view.attempts) == ("80%", "90%", 2)
    # productive first, then the badput by size; an empty bucket is left out
    assert [r.kind for r in view.rows] == ["productive", "progress_lost", "startup"]
    assert [r.share for r in view.rows] == [80.0, 15.0, 5.0]
    assert view.rows[1].label == "Progress lost" and view.rows[1].percent == "15%"
