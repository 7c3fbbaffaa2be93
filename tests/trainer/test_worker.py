"""The worker as the daemon runs it: under torchrun, reporting over a Unix socket."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

from traind.contracts.events import (
    Event,
    LifecycleEvent,
    StepEvent,
    decode,
    decode_complete,
    encode,
)
from traind.trainer.checkpoint import latest

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


class EventServer:
    """A stand-in for the daemon's socket: accepts connections, decodes every line."""

    def __init__(self, path: Path) -> None:
        self.events: list[Event] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen()
        self._sock.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                self.events.append(decode(line))

    def wait_for(self, predicate: type | str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if isinstance(predicate, str):
                    if isinstance(e, LifecycleEvent) and e.phase == predicate:
                        return True
                elif isinstance(e, predicate):
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._sock.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EventServer]:
    srv = EventServer(tmp_path / "events.sock")
    yield srv
    srv.close()


def _launch(tmp_path: Path, steps: int, nproc: int = 1) -> subprocess.Popen[bytes]:
    cfg = {
        "job": {"steps": steps, "batch_size": 4, "threads": 1, "out_dir": str(tmp_path / "out"),
                "eval_every": 10_000, "checkpoint_every": 10_000},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000},
        "telemetry": {"every": 5},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node", str(nproc), "-m", "traind.trainer.worker",
         "--config", str(tmp_path / "config.json"), "--events", str(tmp_path / "events.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


@pytest.mark.parametrize("nproc", [1, 2])
def test_worker_reports_steps_and_finishes(tmp_path: Path, server: EventServer,
                                           nproc: int) -> None:
    proc = _launch(tmp_path, steps=20, nproc=nproc)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out.decode()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(
            isinstance(e, LifecycleEvent) and e.phase == "finished" for e in server.events) < nproc:
        time.sleep(0.05)
    for rank in range(nproc):
        mine = [e for e in server.events if e.rank == rank]
        assert [e.step for e in mine if isinstance(e, StepEvent)] == [5, 10, 15, 20]
        phases = [e.phase for e in mine if isinstance(e, LifecycleEvent)]
        assert phases == ["started", "checkpoint", "finished"] if rank == 0 else [
            "started", "finished"]  # only rank 0 writes checkpoints
    if nproc == 2:  # gloo all-reduce: both ranks step with the same averaged gradient
        norms = {(e.rank, e.step): e.grad_norm for e in server.events if isinstance(e, StepEvent)}
        assert all(norms[0, s] == pytest.approx(norms[1, s]) for s in (5, 10, 15, 20))
    assert latest(tmp_path / "out") == tmp_path / "out" / "step_00000020.pt"


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path: Path, server: EventServer) -> None:
    proc = _launch(tmp_path, steps=1_000_000)
    try:
        assert server.wait_for(StepEvent, timeout=60), "no step event"
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the worker
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert server.wait_for("finished", timeout=5), out.decode()
    finished = [e for e in server.events if isinstance(e, LifecycleEvent)][-1]
    assert finished.phase == "finished" and finished.detail["stopped"] is True
    path = latest(tmp_path / "out")
    assert path is not None and path.name == f"step_{finished.step:08d}.pt"
    # torchrun itself ends with a SignalException traceback and status 1 whatever its workers
    # did, so the events (finished, stopped=True) are what say the stop was graceful; the
    # worker's own output carries no traceback.
    assert b"trainer/loop.py" not in out and b"trainer/worker.py" not in out, out.decode()


def test_a_half_written_last_line_is_not_yet_an_event() -> None:
    # A reader polling a file the worker is still appending to can catch a line half copied
    # (CI once did): it must see the complete lines and wait for the rest.
    lines = [encode(LifecycleEvent(rank=0, phase="started", step=0)),
             encode(LifecycleEvent(rank=0, phase="checkpoint", step=3))]
    data = lines[0] + lines[1][:20]
    assert decode_complete(data) == [decode(lines[0])]
    assert decode_complete(lines[0] + lines[1]) == [decode(x) for x in lines]
    assert decode_complete(b"") == []
    with pytest.raises(ValueError, match="not JSON"):
        decode_complete(b"{oops\n")


def test_an_orphan_stuck_where_stop_is_never_read_still_exits(tmp_path: Path) -> None:
    # A rank whose launcher died while it waited in a rendezvous (a multi-node peer gone too)
    # never reads `stop`; once orphaned it must still leave, after the grace period.
    import psutil

    child = (
        "import threading, time\n"
        "from traind.trainer.worker import watch_parent\n"
        "watch_parent(threading.Event(), interval=0.05, grace=0.5)\n"
        "print('watching', flush=True)\n"
        "time.sleep(600)  # stuck: never looks at stop\n")
    launcher = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE,\n"
        "                      stderr=subprocess.DEVNULL, text=True)\n"
        "assert p.stdout.readline() == 'watching\\n'\n"
        "print(p.pid, flush=True)\n")  # then the launcher dies, leaving its child
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                         timeout=60, check=True)
    orphan = psutil.Process(int(out.stdout.split()[0]))
    deadline = time.monotonic() + 20

    def gone() -> bool:  # exited: no process, or a zombie its new parent has not reaped yet
        try:
            return orphan.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(), "the orphaned rank is still running"
    finally:
        if not gone():
            orphan.kill()
