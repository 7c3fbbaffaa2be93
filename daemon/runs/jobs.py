"""Launching a training job: torchrun workers, their event socket, and their exit.

One ``Job`` is one ``torch.distributed.run`` process (even for one rank: the same elastic agent
that runs a multi-node job) whose ranks run ``traind.trainer.worker``. The job listens on its own
Unix socket for the ranks' JSON-line events and hands each decoded event to ``on_event``; when
the launcher exits, ``wait()`` returns a ``JobExit`` with the code and the last log lines.
The runner knows nothing of the database or the registry: the caller wires those.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from traind.contracts import failure
from traind.contracts.events import Event, decode

if TYPE_CHECKING:
    from traind.trainer.config import JobConfig, TrainConfig

EventCallback = Callable[[Event], None]

# torchrun's failure summary names the first rank that failed and how:
#   Root Cause (first observed failure):
#   [0]:
#     ...
#     rank      : 1 (local_rank: 1)
#     exitcode  : -9 (pid: 3787)
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)",
                         re.DOTALL)


_FAILURE = re.compile(r"rank\s*:\s*(?P<rank>\d+)[^\n]*\n\s*exitcode\s*:\s*(?P<code>-?\d+)")


def root_cause(log_tail: str) -> tuple[int, int] | None:
    """The (rank, exit code) of the rank that failed first, from torchrun's summary in the
    log; a negative code is the signal that killed it. None when there is no summary.

    A rank killed by a signal wins over one that exited with an error: when one rank is
    killed, its peers fail in their next collective within the same instant, and which of
    the two torchrun observed first is a race; the kill is the cause."""
    m = _ROOT_CAUSE.search(log_tail)
    if m is None:
        return None
    cause = (int(m["rank"]), int(m["code"]))
    if cause[1] < 0:
        return cause
    # SIGTERM is torchrun's own: it stops the surviving ranks after the first failure.
    killed = [(int(f["rank"]), int(f["code"])) for f in _FAILURE.finditer(log_tail)
              if int(f["code"]) < 0 and int(f["code"]) != -signal.SIGTERM]
    return killed[0] if killed else cause


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True, slots=True)
class JobExit:
    code: int
    stopped: bool  # the daemon asked it to stop
    log_tail: str
    # Each failed rank's error line (contracts/failure.py), from the log's end.
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def state(self) -> str:
        if self.stopped:
            return "stopped"
        return "completed" if self.code == 0 else "failed"

    @property
    def signal(self) -> str | None:
        """The signal that ended the job: the launcher's own, or else the failed rank's
        (torchrun itself exits 1 when a rank is killed, so its code alone hides the signal)."""
        cause = root_cause(self.log_tail)
        code = self.code if self.code < 0 else cause[1] if cause else 0
        if code >= 0:
            return None
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"

    def headline(self) -> str | None:
        """The failure in one line: which rank, how, and its own error where it said one
        (None unless the job failed)."""
        if self.state != "failed":
            return None
        cause = root_cause(self.log_tail)
        if self.code < 0:
            how = f"worker launcher {_how(self.code)}"
        elif cause is not None:
            how = (f"worker rank {cause[0]} {_how(cause[1])} (launcher exit code "
                   f"{self.code})")
        else:
            how = f"worker exit code {self.code}"
        rank = cause[0] if cause is not None else None
        said = self.errors.get(rank) if rank is not None else None
        own = [r for r in sorted(self.errors) if not failure.peer_gone(self.errors[r])]
        if self.code >= 0 and own and (said is None or failure.peer_gone(said)):
            # torchrun's first failure was a peer of the rank that failed by itself
            rank, said = own[0], self.errors[own[0]]
            how = f"worker rank {rank} failed (launcher exit code {self.code})"
        elif said is None and self.errors:  # the cause said nothing: the first that did
            said = self.errors[min(self.errors)]
        return f"{how}: {said}" if said else how

    def describe(self) -> str | None:
        if (how := self.headline()) is None:
            return None
        return f"{how}\n--- last log lines ---\n{self.log_tail}"


# Sharing torchrun's rendezvous store with the ranks (torch's default) breaks its own restarts:
# a restarted rank can read the previous attempt's peer addresses from the store and time out
# connecting to a dead rank (pytorch/pytorch#135712). Unshared, rank 0 hosts a fresh store per
# attempt.
LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch_command(config_path: Path, socket_path: str | None, job: JobConfig) -> list[str]:
    """The torchrun command line for one job (pure: tested without launching)."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if job.nnodes == 1:
        cmd.append("--standalone")  # single node: c10d rendezvous on a free local port
    else:
        # Every node runs the same command; c10d rendezvous at the endpoint groups them.
        cmd += [f"--nnodes={job.nnodes}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={job.rdzv_endpoint}", f"--rdzv_id=traind-{job.name}"]
        if job.local_addr:
            # Said outright: torchrun would guess both from the host name, which on a node
            # with several networks (or in a network namespace) names the wrong one.
            host = (job.rdzv_endpoint or "").rsplit(":", 1)[0].strip("[]")
            cmd += [f"--local_addr={job.local_addr}",
                    f"--rdzv_conf=is_host={str(host == job.local_addr).lower()}"]
    cmd += [
        f"--nproc_per_node={job.nproc_per_node}",
        # torchrun restarts every rank when one fails; they resume from the last complete
        # checkpoint (trainer/loop.py), so a restart loses at most checkpoint_every steps.
        f"--max_restarts={job.max_restarts}",
        "-m", "traind.trainer.worker",
        "--config", str(config_path),
    ]
    if socket_path:
        cmd += ["--events", socket_path]
    return cmd


class Job:
    def __init__(self, cfg: TrainConfig, out_dir: Path, on_event: EventCallback,
                 *, log_lines: int = 40, env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.env = env or {}  # added to the launcher's environment (e.g. GLOO_SOCKET_IFNAME)
        self.out_dir = out_dir
        self.on_event = on_event
        self.bad_events = 0  # lines that did not decode as events
        self._log_lines = log_lines
        self._proc: asyncio.subprocess.Process | None = None
        self._server: asyncio.AbstractServer | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._sock_dir = ""
        self._stopping = False

    @property
    def log_path(self) -> Path:
        return self.out_dir / LOG_NAME

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.out_dir / "config.json"
        config_path.write_text(self.cfg.model_dump_json(indent=2))
        # Unix socket paths are limited to ~107 bytes, so they live in a short temp folder.
        sweep_stale_sockets()  # those of jobs whose daemon was killed before it removed them
        self._sock_dir = tempfile.mkdtemp(prefix=SOCKET_PREFIX)
        sock = os.path.join(self._sock_dir, SOCKET_NAME)
        self._server = await asyncio.start_unix_server(self._read_events, path=sock)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **LAUNCH_ENV, **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *launch_command(config_path, sock, self.cfg.job),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True,  # a terminal's Ctrl-C goes to the daemon, not the job
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    async def wait(self) -> JobExit:
        assert self._proc is not None, "start() first"
        code = await self._proc.wait()
        await self._close_server()
        return JobExit(code=code, stopped=self._stopping, log_tail=self._tail(),
                       errors=failure.errors(read_tail(self.log_path, 10_000)) if code else {})

    async def stop(self, grace: float = 30.0) -> None:
        """Ask the ranks to checkpoint and exit (SIGTERM to the workers, so the launcher sees
        them finish cleanly); kill the whole group if they have not gone after ``grace``."""
        if self._proc is None or self._proc.returncode is not None:
            return
        self._stopping = True
        for child in _children(self._proc.pid):
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._proc.wait()), grace)
        except TimeoutError:
            # torchrun starts each rank in a session of its own, so a process-group kill would
            # miss them: kill the launcher's whole tree, ranks first.
            procs = [*_children(self._proc.pid, recursive=True), psutil.Process(self._proc.pid)]
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()

    def worker_pids(self) -> list[int]:
        return [self._proc.pid] if self._proc and self._proc.returncode is None else []

    async def _read_events(self, reader: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._readers.add(task)
        try:
            while line := await reader.readline():
                try:
                    event = decode(line)
                except ValueError:
                    self.bad_events += 1
                    continue
                self.on_event(event)
        finally:
            self._readers.discard(task)
            _w.close()

    async def _close_server(self) -> None:
        # The ranks have exited, so their sockets are closed: drain what they sent, then close.
        if self._readers:
            await asyncio.wait(set(self._readers), timeout=5)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    def _tail(self) -> str:
        return read_tail(self.log_path, self._log_lines)


# The folder's name and content are the job's alone: a sweep takes nothing else in /tmp (a
# "traind-*" folder of the user's own, .ci/newcomer's copy say, is not a socket folder).
SOCKET_PREFIX = "traind-sock-"
SOCKET_NAME = "events.sock"
# A socket folder is stale only when nobody listens on it and it is older than this: a folder
# just made has its socket bound microseconds later, in the same coroutine.
STALE_SOCKET_SECONDS = 2.0


def sweep_stale_sockets(root: Path | None = None, *,
                        older_than: float = STALE_SOCKET_SECONDS) -> list[Path]:
    """Remove the event-socket folders that killed daemons left (SIGKILL runs no clean-up):
    this user's ``traind-sock-*`` folders under ``root`` (the temp folder) that hold nothing
    but a socket nobody listens on (or nothing), untouched for ``older_than`` seconds. Those
    removed."""
    root = Path(tempfile.gettempdir()) if root is None else root
    removed = []
    for folder in root.glob(f"{SOCKET_PREFIX}*"):
        try:
            st = folder.lstat()
        except OSError:
            continue
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
                or time.time() - st.st_mtime < older_than):
            continue
        try:
            held = os.listdir(folder)
        except OSError:
            continue
        if set(held) - {SOCKET_NAME} or _listening(folder / SOCKET_NAME):
            continue  # not only a dead socket: not ours to remove
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _listening(path: Path) -> bool:
    """Whether a live daemon serves the socket at ``path`` (it reads a connection that sends
    nothing to its end and closes it)."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


LOG_NAME = "worker.log"  # in the run's folder: the launcher's and every rank's output
TAIL_BYTES = 64 * 1024  # a long run's log may be large: read only its end


def read_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path`` ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            if f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES)):
                f.readline()  # the first line read from the middle is cut: leave it out
            kept: deque[bytes] = deque(f, maxlen=lines)
    except OSError:
        return ""
    return b"".join(kept).decode(errors="replace")


def log_tail(out_dir: str, lines: int = 60) -> str:
    """A run's log tail from its recorded folder ("" without one)."""
    return read_tail(Path(out_dir) / LOG_NAME, lines) if out_dir else ""


def _children(pid: int, *, recursive: bool = False) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=recursive)
    except psutil.Error:
        return []


def _die_with_parent() -> None:
    """In the launcher's child before exec: SIGTERM it when the daemon dies (Linux), which
    torchrun forwards to the ranks; the ranks also watch their own parent (worker.py)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
