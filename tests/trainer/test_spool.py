"""Each rank's spool (issue 40.1): what it sent is on disk even when the daemon is gone, in
two bounded segments, locked while the rank lives and free once it dies, however it dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from traind.contracts import spool
from traind.contracts.events import LifecycleEvent, encode
from traind.daemon.runs.recovery import busy, spooled
from traind.trainer.sink import SocketSink, Spool

if TYPE_CHECKING:
    from pathlib import Path


def _event(step: int) -> LifecycleEvent:
    return LifecycleEvent(rank=0, phase="checkpoint", step=step, detail={"pad": "x" * 80},
                          time=1e9 + step)


def test_what_a_rank_sends_after_its_daemon_died_is_in_its_spool(tmp_path: Path) -> None:
    path = str(tmp_path / "events.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    sink = SocketSink(path, spool=Spool(tmp_path / "run", 0))
    conn, _ = server.accept()
    sink.emit(_event(1))
    time.sleep(0.2)  # the drain thread sends it (nothing below depends on the timing)
    conn.close()
    server.close()  # the daemon is gone: sends fail from here on
    for step in range(2, 40):
        sink.emit(_event(step))
    sink.close()
    assert [e.step for e in spooled(tmp_path / "run")] == list(range(1, 40))


def test_the_spool_keeps_two_segments_of_the_newest_events(tmp_path: Path) -> None:
    s = Spool(tmp_path, 3, segment_bytes=2_000)
    for step in range(1, 200):
        s.write(encode(_event(step)))
    s.close()
    older, current = spool.segments(tmp_path, 3)
    assert older.stat().st_size <= 2_000 and current.stat().st_size <= 2_000
    steps = [e.step for e in spooled(tmp_path)]
    assert steps == list(range(steps[0], 200)) and steps[0] > 150  # the newest, in order


def test_a_rank_s_lock_is_held_while_it_lives_and_freed_by_a_sigkill(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from pathlib import Path\n"
         "from traind.trainer.sink import Spool\n"
         "Spool(Path(sys.argv[1]), 0)\n"
         "print('locked', flush=True)\n"
         "time.sleep(600)\n", str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
        assert busy([tmp_path]) == [tmp_path]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert busy([tmp_path]) == []  # the kernel let go with the process
    finally:
        proc.kill()
        proc.wait()
