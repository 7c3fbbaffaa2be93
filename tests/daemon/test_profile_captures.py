"""The daemon's half of a profile on demand (daemon/profiles/captures.py): what it refuses,
the request the job reads, the capture's states, and the report built once every chosen rank
of this node has sent its trace, or with what there is when the run ends."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import TYPE_CHECKING

import pytest

from tests.daemon.test_profile_analysis import host_trace
from traind.contracts.control import PROFILE_REQUEST, read_profile_request
from traind.contracts.events import LifecycleEvent
from traind.daemon.profiles.captures import Profiles, trace_file
from traind.daemon.service import ProfileRefused

if TYPE_CHECKING:
    from pathlib import Path

RUN = 4


def started(profiles: Profiles, ranks: int = 2) -> None:
    for rank in range(ranks):
        profiles.observe(RUN, LifecycleEvent(rank=rank, phase="started", step=0,
                                             detail={"world_size": ranks}))


def traced(profiles: Profiles, out: Path, rank: int, capture: int = 1) -> None:
    """What a rank does: its trace in the capture's folder, then its event."""
    folder = out / "profiles" / str(capture)
    (folder / f"rank{rank}.json.gz").write_bytes(gzip.compress(json.dumps(host_trace(
        base_ns=10**12 + rank * 1000)).encode()))
    profiles.observe(RUN, LifecycleEvent(rank=rank, phase="profiled", step=8, detail={
        "capture": capture, "steps": 2, "first_step": 7, "last_step": 8,
        "clock_offset": 0.0, "file": f"rank{rank}.json.gz"}))


def test_a_profile_is_refused_with_the_reason(tmp_path: Path) -> None:
    p = Profiles()
    with pytest.raises(ProfileRefused, match="has not started training") as e:
        p.ask(RUN, tmp_path, steps=3)
    assert e.value.conflict
    started(p)
    for kw, field, words in (({"steps": 0}, "steps", "between 1 and 50"),
                             ({"steps": 51}, "steps", "between 1 and 50"),
                             ({"steps": 3, "ranks": [0, 2]}, "ranks", "ranks 0 to 1 .not 2."),
                             ({"steps": 3, "ranks": []}, "ranks", "at least one rank")):
        with pytest.raises(ProfileRefused, match=words) as e:
            p.ask(RUN, tmp_path, **kw)  # type: ignore[arg-type]
        assert e.value.field == field
    assert not (tmp_path / PROFILE_REQUEST).exists()  # nothing half-asked
    c = p.ask(RUN, tmp_path, steps=3, ranks=[1, 1])
    assert (c.capture, c.ranks, c.state) == (1, (1,), "waiting")
    request = read_profile_request(tmp_path / PROFILE_REQUEST)
    assert request is not None and (request.capture, request.steps, request.ranks) == (1, 3, (1,))
    with pytest.raises(ProfileRefused, match="capture 1 of run 4 is still under way"):
        p.ask(RUN, tmp_path, steps=3)


def test_the_report_is_built_when_every_chosen_rank_has_traced(tmp_path: Path) -> None:
    async def go() -> None:
        p = Profiles()
        started(p)
        p.ask(RUN, tmp_path, steps=2)
        (tmp_path / PROFILE_REQUEST).unlink()  # the job took it
        traced(p, tmp_path, 0)
        assert p.capture(RUN, tmp_path, 1, running=True).state == "waiting"  # rank 1 next
        traced(p, tmp_path, 1)
        assert p.capture(RUN, tmp_path, 1, running=True).state == "analysing"
        await p.idle()
        c = p.capture(RUN, tmp_path, 1, running=True)
        assert (c.state, c.traces, c.first_step, c.last_step) == ("ready", (0, 1), 7, 8)
        body = json.loads((tmp_path / "profiles" / "1" / "report.json").read_text())
        assert [r["rank"] for r in body["ranks"]] == [0, 1] and body["capture"] == 1
        assert body["straggler"][0]["last"] == 1  # its trace's clock starts 1 µs later
        assert set(body["trace_bytes"]) == {"0", "1"}
        # the next capture may be asked now, and is numbered after the last
        assert p.ask(RUN, tmp_path, steps=2).capture == 2

    asyncio.run(go())


def test_a_run_that_ends_mid_capture_gets_what_it_traced_or_the_reason(
        tmp_path: Path) -> None:
    async def go() -> None:
        p = Profiles()
        started(p)
        p.ask(RUN, tmp_path, steps=2)
        traced(p, tmp_path, 1)
        p.ended(RUN)  # rank 0 never sent its trace
        await p.idle()
        c = p.capture(RUN, tmp_path, 1, running=False)
        assert c.state == "ready" and c.traces == (1,)

        (tmp_path / PROFILE_REQUEST).unlink()
        started(p)
        p.ask(RUN, tmp_path, steps=2)
        p.ended(RUN)  # nobody traced
        await p.idle()
        c = p.capture(RUN, tmp_path, 2, running=False)
        assert c.state == "failed" and "the run ended before the capture" in (c.error or "")

    asyncio.run(go())


def test_captures_are_read_back_from_disk_and_downloads_take_numbers_only(
        tmp_path: Path) -> None:
    async def go() -> None:
        p = Profiles()
        started(p)
        p.ask(RUN, tmp_path, steps=2)
        traced(p, tmp_path, 0)
        traced(p, tmp_path, 1)
        await p.idle()

    asyncio.run(go())
    again = Profiles()  # a daemon that restarted
    assert [c.state for c in again.captures(RUN, tmp_path, running=False)] == ["ready"]
    assert trace_file(tmp_path, 1, 0) == tmp_path / "profiles" / "1" / "rank0.json.gz"
    assert trace_file(tmp_path, 1, 5) is None and trace_file(tmp_path, 9, 0) is None
    # a capture asked but never taken by a job that ended with its daemon
    (tmp_path / "profiles" / "2").mkdir()
    assert again.capture(RUN, tmp_path, 2, running=False).state == "incomplete"


def test_a_run_keeps_its_newest_captures_and_numbers_on(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: captures were never pruned (40 of them on disk and in RSS)."""
    from traind.daemon.profiles import captures

    monkeypatch.setattr(captures, "KEEP_CAPTURES", 3)

    async def go() -> None:
        p = Profiles()
        started(p, ranks=1)
        for n in range(1, 6):
            assert p.ask(RUN, tmp_path, steps=2).capture == n
            (tmp_path / PROFILE_REQUEST).unlink()  # the job took it
            traced(p, tmp_path, 0, capture=n)
            await p.idle()
        assert captures.capture_numbers(tmp_path) == [3, 4, 5]
        assert [c.capture for c in p.captures(RUN, tmp_path, running=True)] == [5, 4, 3]
        assert trace_file(tmp_path, 1, 0) is None and trace_file(tmp_path, 5, 0) is not None

    asyncio.run(go())
