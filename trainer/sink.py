"""Where a worker's events go, without ever blocking a training step.

``SocketSink`` puts each event on a bounded queue (``put_nowait``); a daemon thread drains the
queue in batches to the daemon's Unix socket. When the queue is full the event is dropped and
counted, and the count travels in the next step event. A daemon that is gone is not an error
for training: the sink stops sending and keeps counting.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING, Protocol

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


class SocketSink:
    _STOP = object()

    def __init__(self, path: str, *, maxsize: int = 4096, connect_timeout: float = 10.0) -> None:
        self.dropped = 0
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
