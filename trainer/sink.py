"""Where a worker's events go, without ever blocking a training step.

``SocketSink`` puts each event on a bounded queue (``put_nowait``); a daemon thread drains the
queue in batches to the daemon's Unix socket. When the queue is full the event is dropped and
counted, and the count travels in the next step event. A daemon that is gone is not an error
for training: the sink stops sending and keeps counting. With a :class:`Spool` each batch is
also appended to the rank's spool in its run folder first (contracts/spool.py), so what a
killed daemon never stored is there for the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, BinaryIO, Protocol

from traind.contracts import spool
from traind.contracts.events import Event, encode

if TYPE_CHECKING:
    from pathlib import Path


class EventSink(Protocol):
    dropped: int

    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Discards everything (a library caller that wants no telemetry)."""

    dropped = 0

    def emit(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass


class ListSink:
    """Keeps every event in memory: for tests and for in-process callers."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.dropped = 0

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


class FileSink:
    """Appends each event as a JSON line to a file, flushed per line so that a killed process
    leaves every event it emitted (for tests and offline runs; not the hot path's choice)."""

    def __init__(self, path: Path) -> None:
        self.dropped = 0
        self._f = open(path, "ab")  # noqa: SIM115 - closed in close()

    def emit(self, event: Event) -> None:
        self._f.write(encode(event))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


# A rank of the run's previous life may still be saving its stop checkpoint (30 s at most:
# contracts.spool.ORPHAN_GRACE_SECONDS); past this the new rank spools without the lock.
LOCK_WAIT_SECONDS = 60.0


def _lock(fd: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                sys.stderr.write("traind worker: the event spool is still locked by another "
                                 "process; spooling without the lock\n")
                return
            time.sleep(0.1)


class Spool:
    """Rank ``rank``'s spool in ``out_dir`` (contracts/spool.py), locked while it is open.

    Appended with plain writes, no fsync: a killed process's writes are in the page cache,
    and the spool is for a killed daemon, not a lost machine. A write that fails (a full
    disk) ends spooling with one line on stderr; training goes on."""

    def __init__(self, out_dir: Path, rank: int, *,
                 segment_bytes: int = spool.SEGMENT_BYTES) -> None:
        self._older, self._current = spool.segments(out_dir, rank)
        self._limit = segment_bytes
        self._current.parent.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(spool.lock_file(out_dir, rank), os.O_RDWR | os.O_CREAT, 0o600)
        _lock(self._lock, LOCK_WAIT_SECONDS)
        self._f: BinaryIO | None = open(self._current, "ab")  # noqa: SIM115 - close()
        self._size = self._f.tell()

    def write(self, payload: bytes) -> None:
        if self._f is None:
            return
        try:
            if self._size and self._size + len(payload) > self._limit:
                self._f.close()
                self._current.replace(self._older)
                self._f, self._size = open(self._current, "ab"), 0  # noqa: SIM115
            self._f.write(payload)
            self._f.flush()
            self._size += len(payload)
        except OSError as exc:
            sys.stderr.write(f"traind worker: the event spool stops ({exc}); events still "
                             "go to the daemon\n")
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        os.close(self._lock)  # and with it the lock


class SocketSink:
    _STOP = object()

    def __init__(self, path: str, *, maxsize: int = 4096, connect_timeout: float = 10.0,
                 spool: Spool | None = None) -> None:
        self.dropped = 0
        self._spool = spool
        self._queue: queue.Queue[object] = queue.Queue(maxsize=maxsize)
        self._sock = _connect(path, connect_timeout)
        self._thread = threading.Thread(target=self._drain, name="traind-events", daemon=True)
        self._thread.start()

    def emit(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (up to ``timeout``), then close the socket."""
        with contextlib.suppress(queue.Full):
            self._queue.put(self._STOP, timeout=timeout)
        self._thread.join(timeout)
        self._sock.close()
        if self._spool is not None and not self._thread.is_alive():
            self._spool.close()

    def _drain(self) -> None:
        alive = True
        while True:
            batch = [self._queue.get()]
            while len(batch) < 256:  # batch what has piled up: one syscall, not one per event
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is self._STOP for item in batch)
            payload = b"".join(encode(e) for e in batch if e is not self._STOP)  # type: ignore[arg-type]
            if self._spool is not None and payload:
                self._spool.write(payload)  # first: the send may be the one that fails
            if alive and payload:
                try:
                    self._sock.sendall(payload)
                except OSError:
                    alive = False  # the daemon went away; training goes on
            if not alive:
                self.dropped += sum(1 for e in batch if e is not self._STOP)
            if stop:
                return


def _connect(path: str, timeout: float) -> socket.socket:
    """Connect to the daemon's socket, retrying while it is being created."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
