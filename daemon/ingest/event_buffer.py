"""Run events on their way to the database: held until a write succeeds, never dropped.

When the database refuses writes (read-only, locked, down), a flush keeps what it could not
store and the next one tries again. Memory holds at most ``limit`` events; the rest spill, in
order, to a JSON-lines file under var/ and are written back once the database accepts writes.
``pending`` is what waits (exported as ``traind_db_pending_events``).
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

MEMORY_EVENTS = 100_000  # ~30 MB of small dicts; a busy job sends a few hundred a second


class EventBuffer:
    def __init__(self, spill: Path, *, limit: int = MEMORY_EVENTS) -> None:
        self.spill, self.limit = spill, limit
        self._mem: dict[int, list[dict[str, Any]]] = {}
        self._count = 0
        self._spilled = self._count_spilled()
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._count + self._spilled

    def add(self, run_id: int, event: dict[str, Any]) -> None:
        """Hold ``event`` for run ``run_id``; stamped with the time now (not the time it is
        finally written, which after an outage could be much later)."""
        event.setdefault("time", datetime.now(UTC))
        with self._lock:
            self._mem.setdefault(run_id, []).append(event)
            self._count += 1
            if self._count > self.limit:
                self._spill_all()

    def flush(self, write: Callable[[int, list[dict[str, Any]]], None]) -> None:
        """Write everything pending with ``write(run_id, events)``, the spill file first (it
        is older). On an error the unwritten events stay pending and the error propagates."""
        if self._spilled:
            self._replay(write)
        with self._lock:
            mem, self._mem, self._count = self._mem, {}, 0
        for i, (run_id, events) in enumerate(items := list(mem.items())):
            try:
                write(run_id, events)
            except BaseException:
                with self._lock:  # put back what is left, ahead of what came meanwhile
                    for rid, evs in items[i:]:
                        self._mem[rid] = [*evs, *self._mem.get(rid, [])]
                        self._count += len(evs)
                raise

    # ---- the spill file ----

    def _spill_all(self) -> None:
        with self.spill.open("a") as f:
            for run_id, events in self._mem.items():
                for e in events:
                    f.write(_line(run_id, e))
                self._spilled += len(events)
        self._mem, self._count = {}, 0

    def _count_spilled(self) -> int:
        if not self.spill.exists():
            return 0
        with self.spill.open() as f:
            return sum(1 for _ in f)

    def _replay(self, write: Callable[[int, list[dict[str, Any]]], None]) -> None:
        with self._lock:
            lines = self.spill.read_text().splitlines()
        by_run: dict[int, list[dict[str, Any]]] = {}
        for line in _complete(lines):
            rec = json.loads(line)
            event = rec["event"]
            event["time"] = datetime.fromisoformat(event["time"])
            by_run.setdefault(int(rec["run"]), []).append(event)
        runs = list(by_run.items())
        for i, (run_id, events) in enumerate(runs):
            write(run_id, events)
            # Written: the file keeps only the rest, so a failure later writes nothing twice.
            with self._lock:
                tmp = self.spill.with_suffix(".tmp")
                tmp.write_text("".join(_line(r, e) for r, evs in runs[i + 1:] for e in evs))
                tmp.replace(self.spill)
                self._spilled = sum(len(evs) for _, evs in runs[i + 1:])
        with self._lock:
            self.spill.unlink(missing_ok=True)
            self._spilled = 0


def _line(run_id: int, event: dict[str, Any]) -> str:
    t = event.get("time")
    event = {**event, "time": t.isoformat() if isinstance(t, datetime) else t}
    return json.dumps({"run": run_id, "event": event}, default=str) + "\n"


def _complete(lines: Iterable[str]) -> Iterable[str]:
    # A line cut short by a crash mid-write is the only thing that may be lost.
    for line in lines:
        if line.endswith("}"):
            yield line
