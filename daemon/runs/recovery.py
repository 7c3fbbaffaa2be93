"""What a killed daemon never stored, stored by the next one from its runs' spools.

A SIGKILLed daemon loses the events it held for its next flush, and its ranks' last events
(they save a checkpoint when their launcher dies, and report it to a socket nobody reads).
Every rank spools what it sends (contracts/spool.py). At its start the next daemon waits for
the old ranks to be gone (their spool locks free), then, per run they left running, stores
what the spools hold past what the database holds, folds it into the run's summary, gives
every checkpoint on disk its event, and removes the spool (the resumed ranks start a new one).

What counts as stored is the database's tail: per series kind and rank the newest stored step
(the newest chunks'), and the ``(kind, step, rank)`` of every other row. Nothing past the
newest complete checkpoint is replayed: a resumed run trains those steps again, and a step
recorded twice would be counted twice in the sums (tokens, communication).
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import logging
import os
import shutil
import time
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traind.contracts import spool
from traind.contracts.events import CommEvent, Event, LayerEvent, StepEvent, decode
from traind.daemon.db import crud
from traind.daemon.ingest import messages
from traind.daemon.ingest.series import COMM, LAYERS, RANK_STEPS, STEPS, SeriesRecorder
from traind.daemon.runs.checkpoints import step_of
from traind.daemon.runs.summary import RunSummary
from traind.trainer.checkpoint import latest, list_checkpoints

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from sqlalchemy import Engine

log = logging.getLogger("traind")
SERIES_KINDS = (STEPS, LAYERS, RANK_STEPS, COMM)
# The old ranks save and leave within their grace once their launcher is gone; then some.
WAIT_SECONDS = spool.ORPHAN_GRACE_SECONDS + 15.0
_NEWEST = 3  # chunks per kind read for the marks: a rank missing from the newest is in these
LEAD = -1  # the rank the marks of the lead's own series (steps, layers) are kept under


@dataclass(frozen=True)
class Stored:
    """The database's tail of a run. ``marks``: ``(series kind, rank)`` -> the newest step
    stored; ``rows``: ``(kind, step, rank)`` of its other events."""

    marks: dict[tuple[str, int], int]
    rows: set[tuple[str, int, int]]

    def has(self, kind: str, rank: int, step: int) -> bool:
        return step <= self.marks.get((kind, rank), -1)


def marks(chunks: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, int], int]:
    """The newest stored step per series kind and rank, from each kind's newest chunks
    (``daemon/ingest/series.py``'s columns). Steps and layers are the lead rank's
    (:data:`LEAD`)."""
    found: dict[tuple[str, int], int] = {}

    def note(kind: str, rank: int, step: int) -> None:
        found[(kind, rank)] = max(found.get((kind, rank), -1), int(step))

    for kind in (STEPS, LAYERS):
        for chunk in chunks.get(kind, ()):
            for step in chunk.get("step") or ():
                note(kind, LEAD, step)
    for chunk in chunks.get(RANK_STEPS, ()):
        for step, rank in zip(chunk.get("step") or (), chunk.get("rank") or (), strict=False):
            note(RANK_STEPS, rank, step)
    for chunk in chunks.get(COMM, ()):
        reports = chunk.get("reports") or {}
        for step, rank in zip(reports.get("step") or (), reports.get("rank") or (),
                              strict=False):
            note(COMM, rank, step)
    return found


class _Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, _run_id: int, event: dict[str, Any]) -> None:
        self.rows.append(event)


def replay(events: Iterable[Event], stored: Stored, summary: RunSummary, *,
           until: int | None, checkpoints: Sequence[tuple[int, str]] = ()
           ) -> list[dict[str, Any]]:
    """The rows to add for the spooled ``events`` (every rank's, each rank's in order): those
    the database lacks, at step ``until`` or before (None: no bound), as the live ingest
    would have written them; folded into ``summary`` on the way. ``checkpoints``: ``(step,
    path)`` on disk; each without an event gets one, marked ``recovered``. Pure but for the
    summary it folds into."""
    recorder = SeriesRecorder(lambda _run: summary.tokens_per_second,
                              lambda _run: summary.world_size)
    rows = _Rows()
    for event in events:
        if until is not None and event.step > until:
            continue
        lead = summary.lead(event.rank)
        new_rank_step = (isinstance(event, StepEvent)
                         and not stored.has(RANK_STEPS, event.rank, event.step))
        if isinstance(event, StepEvent):
            new = not stored.has(STEPS, LEAD, event.step) if lead else new_rank_step
        elif isinstance(event, LayerEvent):
            new = lead and not stored.has(LAYERS, LEAD, event.step)
        elif isinstance(event, CommEvent):
            new = not stored.has(COMM, event.rank, event.step)
        else:
            row = messages.row(event) if lead else None
            new = row is None or (row["kind"], row["step"], event.rank) not in stored.rows
            if row is not None and new:
                rows.add(0, {**row, "rank": event.rank, "time": _when(event.time)})
        if not new:
            continue
        summary.observe(event)  # the live order: the summary first, then the series
        if lead and isinstance(event, StepEvent | LayerEvent):
            recorder(0, event)
        if isinstance(event, CommEvent) or new_rank_step:
            recorder.every_rank(0, event)
    recorder.seal(rows)
    have = {step for kind, step, _rank in stored.rows if kind == "checkpoint"}
    have |= {r["step"] for r in rows.rows if r["kind"] == "checkpoint"}
    for step, path in checkpoints:
        if step not in have:
            rows.add(0, {"kind": "checkpoint", "step": step, "rank": 0,
                         "data": {"path": path, "recovered": True}})
            summary.checkpoints += 1
    if checkpoints:  # the newest complete one on disk, whichever event named it
        summary.last_checkpoint = max(checkpoints)[1]
    return rows.rows


def _when(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC) if unix > 0 else datetime.now(UTC)


def spooled(out_dir: Path) -> list[Event]:
    """Every rank's spooled events, merged by time (each rank's kept in its order). A line
    that does not decode (cut short by a kill, or from another schema) is skipped."""
    per_rank = []
    for rank in spool.ranks(out_dir):
        events: list[Event] = []
        for segment in spool.segments(out_dir, rank):
            with contextlib.suppress(OSError):
                for line in segment.read_bytes().splitlines(keepends=True):
                    if line.endswith(b"\n"):
                        with contextlib.suppress(ValueError):
                            events.append(decode(line))
        per_rank.append(events)
    return list(heapq.merge(*per_rank, key=lambda e: e.time))


def summary_of(stored: dict[str, Any]) -> RunSummary:
    """A run's summary as the database holds it, to fold more events into."""
    names = {f.name for f in fields(RunSummary) if not f.name.startswith("_")}
    return RunSummary(**{k: v for k, v in stored.items() if k in names and k != "dirty"})


def recover(engine: Engine, run_id: int, out_dir: Path) -> int:
    """Store what run ``run_id``'s spool holds past the database (see the module), then
    remove the spool. Returns how many rows were added."""
    events = spooled(out_dir)
    newest = latest(out_dir)
    until = step_of(newest) if newest is not None else None
    on_disk = [(step_of(p), str(p)) for p in list_checkpoints(out_dir)
               if until is not None and step_of(p) <= until]
    run = crud.get_run(engine, run_id=run_id)
    if run is None or (not events and not on_disk):
        return 0
    summary = summary_of(run.summary)
    chunks = {k: crud.newest_chunks(engine, run_id=run_id, kind=k, n=_NEWEST)
              for k in SERIES_KINDS}
    since = min([e.step for e in events] + [s for s, _ in on_disk], default=0)
    stored = Stored(marks(chunks), crud.event_keys(engine, run_id=run_id, since=since,
                                                          exclude=SERIES_KINDS))
    rows = replay(events, stored, summary, until=until, checkpoints=on_disk)
    if rows:
        crud.add_recovered(engine, run_id=run_id, events=rows, summary=summary.as_dict())
    discard(out_dir)
    return len(rows)


def recover_interrupted(engine: Engine, *, node: str) -> None:
    """At a daemon's start, before its runs are marked interrupted: wait for the ranks a
    killed daemon left to save and leave, then recover each run they trained."""
    left = crud.interrupted_runs(engine, node=node)
    if held := wait_for_ranks([Path(d) for _, d in left]):
        log.warning("ranks of a previous daemon still hold %s; what they spool from now on "
                    "is not stored", ", ".join(map(str, held)))
    for run_id, out_dir in left:
        if n := recover(engine, run_id, Path(out_dir)):
            log.info("run %d: %d events a killed daemon never stored are stored from its "
                     "ranks' spool", run_id, n)


def discard(out_dir: Path) -> None:
    """Remove a run's spool (everything in it is stored)."""
    shutil.rmtree(spool.folder(out_dir), ignore_errors=True)


def busy(out_dirs: Iterable[Path]) -> list[Path]:
    """The folders some rank still holds a spool lock in (a rank of a killed daemon's job,
    still saving)."""
    held = []
    for out_dir in out_dirs:
        for lock in sorted(spool.folder(out_dir).glob("rank*.lock")):
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(out_dir)
                break
            finally:
                os.close(fd)
    return held


def wait_for_ranks(out_dirs: Sequence[Path], timeout: float = WAIT_SECONDS) -> list[Path]:
    """Wait until no rank holds a spool lock in ``out_dirs`` (at most ``timeout``); the
    folders still held then."""
    deadline = time.monotonic() + timeout
    held = busy(out_dirs)
    if held:
        log.info("waiting up to %.0f s for the ranks of a previous daemon to save and leave: "
                 "%s", timeout, ", ".join(map(str, held)))
    while held and time.monotonic() < deadline:
        time.sleep(0.2)
        held = busy(held)
    return held
