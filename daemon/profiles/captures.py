"""Profiles on demand, the daemon's half: ask a running job, collect its traces, build reports.

``ask`` writes the capture's record (``profiles/<capture>/capture.json`` in the run's folder)
and the job's request (contracts/control.PROFILE_REQUEST); each chosen rank on this node then
traces and sends a ``profiled`` event (trainer/profiling.py), which ``observe`` collects. Once
every chosen rank of this node has sent one (or the run ended), the report is built in a
worker thread (daemon/profiles/analysis.py: seconds for a large trace) and written beside the
traces as ``report.json``; a capture that cannot be analysed gets ``error.json`` instead.

Everything a capture is lives in its folder, so the captures of a run that ended, or of a
daemon that restarted, are read back from disk (``captures``); only the ranks a capture still
waits for are held here. A capture is named by its run and number: nothing a web user sends
names a file (``trace_file`` builds the one path a download may take).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traind.contracts.control import (
    PROFILE_DIR,
    PROFILE_REQUEST,
    ProfileRequest,
    read_profile_request,
    request_problems,
    write_json_atomic,
    write_profile_request,
)
from traind.contracts.events import LifecycleEvent
from traind.daemon.profiles.analysis import TraceError, load_trace, report
from traind.daemon.service import Capture, ProfileRefused

if TYPE_CHECKING:
    from pathlib import Path

    from traind.contracts.events import Event

log = logging.getLogger("traind")

RECORD, REPORT, ERROR = "capture.json", "report.json", "error.json"
# Captures a run keeps on disk, the newest: each holds a trace per rank (megabytes each), and
# a run asked every few minutes for days would fill its folder. A new one removes the oldest.
KEEP_CAPTURES = 10
_TRACE = re.compile(r"^rank(\d+)\.json\.gz$")  # trainer/profiling.trace_name


@dataclass(slots=True)
class _Pending:
    """A capture still waiting for this node's chosen ranks."""

    expected: set[int]
    folder: Path  # the capture's
    done: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> profiled detail
    building: bool = False


def profiles_dir(out_dir: Path) -> Path:
    return out_dir / PROFILE_DIR


def capture_numbers(out_dir: Path) -> list[int]:
    root = profiles_dir(out_dir)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def prune(out_dir: Path, *, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` captures of a run (none is under way: ``ask``
    refuses while one is); the numbers removed. Numbers are never reused: the next capture
    is the newest's number plus one."""
    gone = capture_numbers(out_dir)[:-keep or None] if keep > 0 else capture_numbers(out_dir)
    for number in gone:
        shutil.rmtree(profiles_dir(out_dir) / str(number), ignore_errors=True)
    return gone


def trace_file(out_dir: Path, capture: int, rank: int) -> Path | None:
    """The trace of ``rank`` in ``capture`` (None when there is none): the only path a
    download can take, built from numbers."""
    path = profiles_dir(out_dir) / str(int(capture)) / f"rank{int(rank)}.json.gz"
    return path if path.is_file() else None


def trace_files(folder: Path) -> dict[int, Path]:
    """A capture folder's traces by rank, in rank order."""
    found = {int(m.group(1)): p for p in folder.glob("rank*.json.gz")
             if (m := _TRACE.match(p.name))}
    return dict(sorted(found.items()))


def read_report(out_dir: Path, capture: int) -> dict[str, Any] | None:
    return _read_json(profiles_dir(out_dir) / str(int(capture)) / REPORT)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when missing or not one (written atomically, so
    never half a file)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


class Profiles:
    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._local: dict[int, set[int]] = {}  # run -> the ranks that started on this node
        self._world: dict[int, int] = {}  # run -> its world size
        self.tasks: set[asyncio.Future[None]] = set()

    # -- asking --------------------------------------------------------------------------------

    def ask(self, run_id: int, out_dir: Path, *, steps: int,
            ranks: list[int] | None = None) -> Capture:
        """Ask the running job of ``run_id`` for a profile of ``steps`` steps on ``ranks``
        (every rank when None). Refused with the reason: a capture still under way, a rank
        the job does not have, the job not started yet."""
        world = self._world.get(run_id)
        if world is None or not self._local.get(run_id):
            raise ProfileRefused(f"run {run_id} has not started training yet", conflict=True)
        if ranks is not None:
            if not ranks:
                raise ProfileRefused.at(("ranks",), "name at least one rank, or leave it out "
                                        "for every rank")
            if bad := sorted({r for r in ranks if not 0 <= r < world}):
                raise ProfileRefused.at(("ranks",), f"the job has ranks 0 to {world - 1} (not "
                                        f"{', '.join(map(str, bad))})")
        if (busy := self._under_way(run_id, out_dir)) is not None:
            raise ProfileRefused(f"capture {busy} of run {run_id} is still under way",
                                 conflict=True)
        number = max(capture_numbers(out_dir), default=0) + 1
        prune(out_dir, keep=KEEP_CAPTURES - 1)  # room for this one
        chosen_ranks = tuple(sorted(set(ranks))) if ranks else None
        if problems := request_problems(number, steps, chosen_ranks):
            raise ProfileRefused([((name,), why) for name, why in problems])
        request = ProfileRequest(capture=number, steps=steps, ranks=chosen_ranks)
        chosen = request.ranks if request.ranks is not None else tuple(range(world))
        folder = profiles_dir(out_dir) / str(request.capture)
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        write_json_atomic(folder / RECORD, {"capture": request.capture, "steps": steps,
                                            "ranks": list(chosen), "requested": now})
        write_profile_request(out_dir / PROFILE_REQUEST, request)
        expected = set(chosen) & self._local[run_id]
        self._pending[(run_id, request.capture)] = _Pending(expected=expected, folder=folder)
        return Capture(run=run_id, capture=request.capture, steps=steps, ranks=chosen,
                       requested=now, state="waiting", traces=())

    def _under_way(self, run_id: int, out_dir: Path) -> int | None:
        for (run, capture), pending in self._pending.items():
            if run == run_id and (not pending.building or pending.expected - set(pending.done)):
                return capture
        try:
            request = read_profile_request(out_dir / PROFILE_REQUEST)
        except ValueError:
            return None
        return request.capture if request is not None else None

    # -- events (from the router, every rank, on the event loop) -------------------------------

    def observe(self, run_id: int, event: Event) -> None:
        if not isinstance(event, LifecycleEvent):
            return
        if event.phase == "started":
            self._local.setdefault(run_id, set()).add(event.rank)
            self._world[run_id] = int(event.detail.get("world_size", 1))
        elif event.phase == "profiled":
            capture = event.detail.get("capture")
            pending = self._pending.get((run_id, capture)) if isinstance(capture, int) else None
            if pending is None:
                return  # asked by a daemon that has since restarted: read back from disk
            pending.done[event.rank] = dict(event.detail)
            if pending.expected <= set(pending.done):
                self._build(run_id, capture)  # type: ignore[arg-type]

    def ended(self, run_id: int) -> None:
        """The run's job is gone: a capture still waiting is built from what it has."""
        for (run, capture), pending in list(self._pending.items()):
            if run == run_id and not pending.building:
                self._build(run, capture)
        self._local.pop(run_id, None)
        self._world.pop(run_id, None)

    # -- building ------------------------------------------------------------------------------

    def _build(self, run_id: int, capture: int) -> None:
        pending = self._pending[(run_id, capture)]
        pending.building = True
        offsets = {r: float(d.get("clock_offset", 0.0)) for r, d in pending.done.items()}
        errors = {r: str(d["error"]) for r, d in pending.done.items() if d.get("error")}
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, build_report, pending.folder, run_id, capture,
                                      offsets, errors)
        self.tasks.add(future)

        def finished(f: asyncio.Future[None]) -> None:
            self.tasks.discard(f)
            self._pending.pop((run_id, capture), None)
            if not f.cancelled() and (exc := f.exception()) is not None:
                log.error("run %d: profile %d not analysed: %s", run_id, capture, exc)

        future.add_done_callback(finished)

    async def idle(self) -> None:
        """Wait for the reports being built (close, tests)."""
        if self.tasks:
            await asyncio.wait(set(self.tasks))

    # -- reading (any run, running or ended) ---------------------------------------------------

    def captures(self, run_id: int, out_dir: Path, *, running: bool) -> list[Capture]:
        """The run's captures, newest first."""
        return [self.capture(run_id, out_dir, n, running=running)
                for n in reversed(capture_numbers(out_dir))]

    def capture(self, run_id: int, out_dir: Path, capture: int, *, running: bool) -> Capture:
        """The capture from its folder's files (its report is not read: ``read_report``)."""
        folder = profiles_dir(out_dir) / str(int(capture))
        record = _read_json(folder / RECORD) or {}
        error = None
        if (folder / REPORT).is_file():
            state = "ready"
        elif (folder / ERROR).is_file():
            state = "failed"
            error = str((_read_json(folder / ERROR) or {}).get("error",
                                                                "unreadable error record"))
        elif (pending := self._pending.get((run_id, capture))) is not None:
            state = "analysing" if pending.building else "waiting"
        else:
            state = "waiting" if running else "incomplete"
        first, last = record.get("traced") or (None, None)  # set with the report
        return Capture(run=run_id, capture=int(capture), steps=int(record.get("steps", 0)),
                       ranks=tuple(record.get("ranks", ())),
                       requested=float(record.get("requested", 0.0)), state=state,
                       traces=tuple(trace_files(folder)), error=error, first_step=first,
                       last_step=last)


def build_report(folder: Path, run_id: int, capture: int, offsets: dict[int, float],
                 errors: dict[int, str]) -> None:
    """Read the capture's traces, write ``report.json`` (or ``error.json`` saying why not).
    In a worker thread: seconds for a large trace."""
    t0 = time.perf_counter()
    try:
        files = trace_files(folder)
        traces = {rank: load_trace(path) for rank, path in files.items()}
        if not traces:
            why = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())) \
                or "no rank wrote a trace (the run ended before the capture)"
            raise TraceError(why)
        body = report(traces, offsets)
    except (TraceError, ValueError) as exc:
        write_json_atomic(folder / ERROR, {"error": str(exc)})
        return
    body.update(run=run_id, capture=capture, built=time.time(),
                analysis_seconds=time.perf_counter() - t0,
                rank_errors={str(r): e for r, e in sorted(errors.items())},
                trace_bytes={str(r): path.stat().st_size for r, path in files.items()})
    # the traced steps into the record first: the list of captures never reads a report,
    # and a capture is ready once its report is there
    record = _read_json(folder / RECORD) or {}
    write_json_atomic(folder / RECORD, {**record, "traced": [min(body["steps"]),
                                                             max(body["steps"])]})
    write_json_atomic(folder / REPORT, body)
