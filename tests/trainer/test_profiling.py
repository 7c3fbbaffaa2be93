"""The trainer's half of a profile on demand (trainer/profiling.py): a request in the run's
folder is taken at a report step, the chosen ranks trace the next steps into gzipped Chrome
traces and say so in a ``profiled`` event, and the rest of the job trains on untouched."""

from __future__ import annotations

import gzip
import json
import re
import threading
from typing import TYPE_CHECKING, Any

import pytest
from torch.profiler import ProfilerActivity

from tests.trainer.mesh_runs import config, run_ranks
from traind.contracts.control import PROFILE_REQUEST, ProfileRequest, write_profile_request
from traind.contracts.events import LifecycleEvent
from traind.trainer.loop import train
from traind.trainer.profiling import activities
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from traind.trainer.config import TrainConfig


def _marks(path: Path) -> list[int]:
    trace = json.loads(gzip.decompress(path.read_bytes()))
    return sorted(int(m.group(1)) for e in trace["traceEvents"]
                  if (m := re.match(r"traind\.step#(\d+)$", str(e.get("name", "")))))


def _profiled(events: list[Any]) -> list[LifecycleEvent]:
    return [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "profiled"]


def test_cuda_activity_is_traced_on_a_cuda_rank_only() -> None:
    assert activities("cpu") == [ProfilerActivity.CPU]
    assert activities("cuda") == [ProfilerActivity.CPU, ProfilerActivity.CUDA]


def test_one_rank_traces_the_steps_after_the_report_step_that_took_the_request(
        tmp_path: Path, make_config: Callable[..., TrainConfig]) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_profile_request(tmp_path / PROFILE_REQUEST, ProfileRequest(capture=3, steps=4))
    base = make_config(tmp_path, steps=12)
    cfg = base.model_copy(update={"telemetry": base.telemetry.model_copy(update={"every": 5})})
    sink = ListSink()
    train(cfg, sink, stop=threading.Event())
    [done] = _profiled(sink.events)
    # taken at step 5 (the first report step), traced 6-9
    assert done.detail["first_step"] == 6 and done.detail["last_step"] == 9 == done.step
    assert done.detail["capture"] == 3 and done.detail["file"] == "rank0.json.gz"
    assert _marks(tmp_path / "profiles" / "3" / "rank0.json.gz") == [6, 7, 8, 9]
    assert not (tmp_path / PROFILE_REQUEST).exists()
    assert not list((tmp_path / "profiles" / "3").glob(".*"))  # no temporary file left
    # Issue 40: the download's gzip header named torch's temporary file (/tmp/tmp....json)
    assert _gzip_name(tmp_path / "profiles" / "3" / "rank0.json.gz") == "rank0.json"
    [finished] = [e for e in sink.events if isinstance(e, LifecycleEvent)
                  and e.phase == "finished"]
    assert finished.step == 12 and finished.detail["clock"]["profile"] > 0


def test_a_malformed_request_is_dropped_and_training_goes_on(
        tmp_path: Path, make_config: Callable[..., TrainConfig],
        capfd: pytest.CaptureFixture[str]) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / PROFILE_REQUEST).write_text('{"capture": 1, "steps": 500}')
    sink = ListSink()
    result = train(make_config(tmp_path, steps=4), sink, stop=threading.Event())
    assert result.step == 4 and _profiled(sink.events) == []
    assert not (tmp_path / PROFILE_REQUEST).exists()
    assert "not a profile request: steps: between 1 and 50" in capfd.readouterr().err


@pytest.mark.slow
def test_two_ranks_agree_and_only_the_chosen_rank_traces(tmp_path: Path) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_profile_request(tmp_path / PROFILE_REQUEST,
                          ProfileRequest(capture=1, steps=2, ranks=(1,)))
    cfg = config(tmp_path, batch=4, ranks=2, steps=8, telemetry={"every": 2})
    events = run_ranks(tmp_path, cfg, 2)
    assert _profiled(events[0]) == []
    [done] = _profiled(events[1])
    assert (done.detail["first_step"], done.detail["last_step"]) == (3, 4)
    assert "clock_offset" in done.detail and "error" not in done.detail
    folder = tmp_path / "profiles" / "1"
    assert sorted(p.name for p in folder.iterdir()) == ["rank1.json.gz"]
    assert _marks(folder / "rank1.json.gz") == [3, 4]
    # both ranks trained every step (a rank that misses a collective would hang the job)
    assert [max(e.step for e in evs if isinstance(e, LifecycleEvent)
                and e.phase == "finished") for evs in events] == [8, 8]


def _gzip_name(path: Path) -> str | None:
    """The original file name a gzip header carries (RFC 1952's FNAME), None without one."""
    head = path.read_bytes()[:512]
    assert head[:2] == b"\x1f\x8b", head[:4]
    if not head[3] & 0x08:
        return None
    at = 10 + (2 + int.from_bytes(head[10:12], "little") if head[3] & 0x04 else 0)
    return head[at:head.index(b"\0", at)].decode("latin-1")
