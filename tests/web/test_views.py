"""The pure formatting behind the templates, as tables of cases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from traind.daemon.service import RunView
from traind.web.views import (
    DASH,
    current_run,
    fmt_count,
    fmt_duration,
    fmt_number,
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
        (["queued", "running", "completed"], 3, 3),  # the one with live points
        (["queued", "running"], 99, 2),  # live points of a run not listed
    ],
)
def test_current_run(states: list[str], live: int | None, expected: int | None) -> None:
    runs = [view(id=i + 1, state=s) for i, s in enumerate(states)]
    run = current_run(runs, live)
    assert (run.id if run else None) == expected
