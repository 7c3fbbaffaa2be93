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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_MAGIC = b"TRAINDCK"  # after the digest: marks a file this module finished writing
_FOOTER = len(_MAGIC) + hashlib.sha256().digest_size
_NAME = re.compile(r"^step_(\d{8})\.pt$")
_TMP_PREFIX = ".tmp-step_"
_DCP_NAME = re.compile(r"^dcp_step_(\d{8})$")
_DCP_TMP = ".tmp-dcp_step_"
_DCP_DONE = "COMPLETE"
_DCP_EXTRA = "extra.pt"


def checkpoint_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step:08d}.pt"


def save_checkpoint(out_dir: Path, step: int, state: dict[str, Any], *, keep_last: int) -> Path:
    """Write ``state`` atomically as ``out_dir/step_{step:08d}.pt``; keep the newest
    ``keep_last`` checkpoints and delete older ones. Returns the path written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    final = checkpoint_path(out_dir, step)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=_TMP_PREFIX, suffix=".pt")
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


def _prune(out_dir: Path, keep_last: int) -> None:
    for old in list_checkpoints(out_dir)[:-keep_last]:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    # temp files left by a writer that died mid-write: only one process (rank 0) prunes, and
    # it is past its own write, so any that remain are orphans
    for tmp in out_dir.glob(_TMP_PREFIX + "*"):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


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
    state: dict[str, Any] = torch.load(io.BytesIO(payload), map_location=map_location,
                                       weights_only=True)
    return state


def save_sharded(out_dir: Path, step: int, state: dict[str, Any], extra: dict[str, Any], *,
                 keep_last: int, rank: int, barrier: Callable[[], None]) -> Path:
    """Collective: every rank calls it with its shards of ``state``; rank 0's ``extra`` is
    written beside them. Returns ``out_dir/dcp_step_{step:08d}``."""
    import torch.distributed.checkpoint as dcp

    out_dir = Path(out_dir)
    tmp, final = out_dir / f"{_DCP_TMP}{step:08d}", out_dir / f"dcp_step_{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
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
        for orphan in out_dir.glob(_DCP_TMP + "*"):
            shutil.rmtree(orphan, ignore_errors=True)
    barrier()
    return final


def load_sharded(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill ``state`` (shaped like what was saved, on this rank) in place from a sharded
    checkpoint, and return its ``extra``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not (path / _DCP_DONE).is_file():
        raise ValueError(f"sharded checkpoint {path} is incomplete")
    dcp.load(state, checkpoint_id=str(path))
    extra: dict[str, Any] = torch.load(path / _DCP_EXTRA, map_location="cpu", weights_only=True)
    return extra
