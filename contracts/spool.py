"""Each rank's events on disk, beside the socket: what a killed daemon never stored.

A daemon SIGKILLed mid-run loses the events it had received but not yet written (up to a
flush, a second), and its ranks' last events (their stop checkpoint's among them) go nowhere:
the socket is gone. So every rank also appends each batch it sends to a spool in its run
folder, ``events/rank<r>.jsonl`` (the lines :func:`contracts.events.encode` writes), and the
next daemon stores what the database lacks before the run resumes.

Two segments per rank bound the disk: past :data:`SEGMENT_BYTES` the current one becomes
``.1`` (replacing the older) and a new one starts, so the spool always holds the newest
:data:`SEGMENT_BYTES` or more: minutes of a busy job, where a replay needs a flush's second
plus the time the ranks take to save and leave. Each rank holds an exclusive ``flock`` on
``rank<r>.lock`` while it lives (the kernel drops it when the process dies, however it dies):
how the next daemon knows the old ranks are gone before it reads, or resumes in, their folder.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

# A rank whose launcher is gone saves a checkpoint and leaves within this, or exits there and
# then (trainer/worker.py enforces it): how long the next daemon waits for the spool locks.
ORPHAN_GRACE_SECONDS = 30.0
SPOOL_DIR = "events"
SEGMENT_BYTES = 4 << 20
_SEGMENT = re.compile(r"^rank(\d+)\.jsonl$")


def folder(out_dir: Path) -> Path:
    return out_dir / SPOOL_DIR


def segments(out_dir: Path, rank: int) -> tuple[Path, Path]:
    """Rank ``rank``'s ``(older, current)`` segments (either may be missing)."""
    current = folder(out_dir) / f"rank{rank}.jsonl"
    return current.with_name(current.name + ".1"), current


def lock_file(out_dir: Path, rank: int) -> Path:
    return folder(out_dir) / f"rank{rank}.lock"


def ranks(out_dir: Path) -> list[int]:
    """The ranks that spooled into ``out_dir``, in order."""
    found = folder(out_dir)
    if not found.is_dir():
        return []
    return sorted(int(m.group(1)) for p in found.iterdir() if (m := _SEGMENT.match(p.name)))
