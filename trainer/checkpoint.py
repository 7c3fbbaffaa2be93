"""Atomic, self-verifying checkpoints: ``step_00000200.pt`` either is whole or is not there.

Writing: serialise, append a SHA-256 footer, write a temp file in the same folder, flush and
fsync it, ``os.replace`` it to its final name, then fsync the folder so the rename itself
survives a power cut. A reader never sees a half-written ``step_*.pt``; and should a disk or copy
tear one anyway, the footer does not match and :func:`latest` passes over it.

The state is serialised in memory first (to hash it in one pass); at this trainer's model sizes
that is cheap.

Sharded state (FSDP, or ``parallel.sharded_checkpoints``) goes through
torch.distributed.checkpoint into ``.tmp-dcp_step_N/``; every rank writes its shards, rank 0
adds ``extra.pt`` (step, sampler, RNG states: small, unsharded) and a ``COMPLETE`` marker, then
renames the folder to ``dcp_step_N``. A folder without the marker is never loaded. DCP reshards
on load, so such a checkpoint resumes on a different number of ranks.

Retention (``job.keep_last``, 0 = keep all) keeps the newest N *complete* checkpoints: a torn
file never takes the place of a good one. Temp files and folders carry their writer's host and
pid, and are removed only when that writer is gone, so pruning never deletes one being written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

_MAGIC = b"TRAINDCK"  # after the digest: marks a file this module finished writing
_FOOTER = len(_MAGIC) + hashlib.sha256().digest_size
_NAME = re.compile(r"^step_(\d{8})\.pt$")
_TMP_PREFIX = ".tmp-step_"
_DCP_NAME = re.compile(r"^dcp_step_(\d{8})$")
_DCP_TMP = ".tmp-dcp_step_"
_DCP_DONE = "COMPLETE"
_DCP_EXTRA = "extra.pt"
_DCP_OWNER = "OWNER"  # in a temp folder: the writer, as host~pid
# ".tmp-step_00000200~host~1234~a8x.pt": the writer is in the name, so a pruner can tell a
# live writer's file from one a dead writer left behind.
_TMP_OWNER = re.compile(r"^\.tmp-step_\d{8}~(?P<host>[^~]+)~(?P<pid>\d+)~")


def checkpoint_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step:08d}.pt"


def save_checkpoint(out_dir: Path, step: int, state: dict[str, Any], *, keep_last: int) -> Path:
    """Write ``state`` atomically as ``out_dir/step_{step:08d}.pt``; keep the newest
    ``keep_last`` complete checkpoints (0 = all) and delete older ones. Returns the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    import torch  # here: the daemon reads checkpoint paths and must not pay for torch

    torch.save(state, buf)
    payload = buf.getbuffer()
    final = checkpoint_path(out_dir, step)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f"{_TMP_PREFIX}{step:08d}~{_owner()}~",
                               suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.write(hashlib.sha256(payload).digest() + _MAGIC)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(out_dir)
    _prune(out_dir, keep_last)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host() -> str:
    return socket.gethostname().replace("~", "-")


def _owner() -> str:
    return f"{_host()}~{os.getpid()}"


def _writer_gone(owner: str | None) -> bool:
    """Whether the writer ``host~pid`` of a temp file or folder can no longer finish it.

    Unknown owners (names from older versions) count as gone; writers on another host (a
    shared file system) are never judged from here. This process is past its own write when it
    prunes, so its own leftovers are gone too."""
    if owner is None:
        return True
    host, _, pid = owner.partition("~")
    if not pid.isdigit():
        return True  # not a name this module writes
    if host != _host():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _temp_owner(path: Path) -> str | None:
    if path.is_dir():
        try:
            return (path / _DCP_OWNER).read_text().strip() or None
        except OSError:
            return None
    m = _TMP_OWNER.match(path.name)
    return f"{m['host']}~{m['pid']}" if m else None


def _is_complete(path: Path) -> bool:
    """A sharded folder with its marker, or a file whose checksum verifies."""
    if path.is_dir():
        return (path / _DCP_DONE).is_file()
    return _read_verified(path) is not None


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _prune(out_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (0 = all) and delete the other
    finished names (older complete ones, and torn ones: a final name only ever comes from a
    rename of a whole file, so a torn one can never become complete). Then remove temp files
    and folders whose writer is gone; a live writer's are left alone."""
    if keep_last > 0:
        kept = 0
        for path in reversed(list_checkpoints(out_dir)):  # newest first
            # once N are kept, older ones go unread: pruning costs N verifications, not all
            if kept < keep_last and _is_complete(path):
                kept += 1
            else:
                _remove(path)
    for tmp in [*out_dir.glob(_TMP_PREFIX + "*"), *out_dir.glob(_DCP_TMP + "*")]:
        if _writer_gone(_temp_owner(tmp)):
            _remove(tmp)


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name) or _DCP_NAME.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Checkpoint files and sharded folders in ``out_dir`` by step, oldest first (unverified;
    temp files and folders excluded)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir()
             if (_NAME.match(p.name) and p.is_file()) or (_DCP_NAME.match(p.name) and p.is_dir())]
    return sorted(found, key=lambda p: _step_of(p) or 0)


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir()


def _read_verified(path: Path) -> bytes | None:
    """The payload of ``path`` when its footer matches, else None."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) <= _FOOTER or not data.endswith(_MAGIC):
        return None
    payload, digest = data[:-_FOOTER], data[-_FOOTER : -len(_MAGIC)]
    return payload if hashlib.sha256(payload).digest() == digest else None


def latest(out_dir: Path) -> Path | None:
    """The newest checkpoint in ``out_dir`` that is complete (its checksum verifies), or None.

    Torn, truncated or foreign ``step_*.pt`` files and temp files are skipped, never returned.
    """
    for path in reversed(list_checkpoints(out_dir)):
        if path.is_dir():
            if (path / _DCP_DONE).is_file():
                return path
        elif _read_verified(path) is not None:
            return path
    return None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state saved in ``path``; ``ValueError`` if the file is incomplete or corrupt.

    ``weights_only=True``: the state holds only tensors and plain containers, so nothing in a
    checkpoint file can run code when loaded.
    """
    payload = _read_verified(path)
    if payload is None:
        raise ValueError(f"checkpoint {path} is incomplete or corrupt")
    import torch

    state: dict[str, Any] = torch.load(io.BytesIO(payload), map_location=map_location,
                                       weights_only=True)
    return state


def save_sharded(out_dir: Path, step: int, state: dict[str, Any], extra: dict[str, Any], *,
                 keep_last: int, rank: int, barrier: Callable[[], None]) -> Path:
    """Collective: every rank calls it with its shards of ``state``; rank 0's ``extra`` is
    written beside them. Returns ``out_dir/dcp_step_{step:08d}``."""
    import torch
    import torch.distributed.checkpoint as dcp

    out_dir = Path(out_dir)
    tmp, final = out_dir / f"{_DCP_TMP}{step:08d}", out_dir / f"dcp_step_{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # this step's, left by an earlier attempt
        tmp.mkdir(parents=True)
        (tmp / _DCP_OWNER).write_text(_owner())
    barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    barrier()  # every rank's shards and rank 0's metadata are written
    if rank == 0:
        torch.save(extra, tmp / _DCP_EXTRA)
        with open(tmp / _DCP_DONE, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(out_dir)
        _prune(out_dir, keep_last)
    barrier()
    return final


def load_sharded(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill ``state`` (shaped like what was saved, on this rank) in place from a sharded
    checkpoint, and return its ``extra``."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not (path / _DCP_DONE).is_file():
        raise ValueError(f"sharded checkpoint {path} is incomplete")
    with warnings.catch_warnings():
        # one process resuming a sharded checkpoint (no process group) is meant: DCP's
        # "assuming the intent is to load in a single process" is right, and noise
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(path))
    extra: dict[str, Any] = torch.load(path / _DCP_EXTRA, map_location="cpu", weights_only=True)
    return extra
