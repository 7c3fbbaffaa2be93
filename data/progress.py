"""A preparation's progress: what ``traind data prepare`` has done so far in its ``--out``
folder, checkpointed atomically after each shard so an interrupted run resumes.

The checkpoint (``progress.pkl``) holds the arguments' hash, the number of source documents
consumed, the shards written, the tokens not yet in a shard, the counts, and the dedup state
(content hashes and the LSH index) as of that position: a resumed run skips that many
documents and continues exactly as the uninterrupted run would have. A finished run keeps a
small one (no dedup state), so the same command again is a no-op and different arguments are
refused.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traind.contracts.control import write_atomic
from traind.data.filters import REASONS
from traind.data.fingerprint import content_hash
from traind.data.manifest import MANIFEST, SPLITS, ShardEntry

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np

    from traind.data.dedup import Dedup

PROGRESS = "progress.pkl"
PROGRESS_VERSION = 2  # 2: removed documents counted in tokens too


def args_hash(args: dict[str, Any]) -> str:
    """The hash of a preparation's arguments (JSON-able values; order of keys is free)."""
    blob = json.dumps(args, sort_keys=True, default=str).encode()
    return content_hash(blob)


@dataclass
class Progress:
    args_hash: str
    position: int = 0  # source documents consumed (kept or not)
    entries: dict[str, list[ShardEntry]] = field(
        default_factory=lambda: {s: [] for s in SPLITS})
    pending: dict[str, np.ndarray | None] = field(
        default_factory=lambda: dict.fromkeys(SPLITS))  # tokens not yet in a shard
    read: list[int] = field(default_factory=lambda: [0, 0])  # documents, bytes
    removed: dict[str, list[int]] = field(
        default_factory=lambda: {r: [0, 0, 0] for r in REASONS})  # documents, bytes, tokens
    kept: dict[str, list[int]] = field(
        default_factory=lambda: {s: [0, 0, 0] for s in SPLITS})  # documents, tokens, bytes
    dedup: Dedup | None = None
    seconds: float = 0.0  # of all sessions, for shards per minute
    tokenize_seconds: float = 0.0
    done: bool = False
    version: int = PROGRESS_VERSION

    def save(self, folder: Path) -> None:
        write_atomic(folder / PROGRESS, pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))


def load(folder: Path) -> Progress | None:
    path = folder / PROGRESS
    if not path.is_file():
        return None
    try:
        progress = pickle.loads(path.read_bytes())  # our own checkpoint
    except Exception as exc:  # a truncated or foreign file: say so
        raise ValueError(f"{path} cannot be read ({exc!r}): use --force to start over") from None
    if not isinstance(progress, Progress) or progress.version != PROGRESS_VERSION:
        raise ValueError(f"{path} is not a checkpoint of this traind: use --force to start over")
    return progress


def ours(folder: Path) -> list[Path]:
    """The files a preparation writes in ``folder`` (what --force removes)."""
    names = {MANIFEST, PROGRESS, "tokenizer.json"}
    return [p for p in folder.iterdir() if p.is_file() and (
        p.name in names or p.name.startswith(".tmp-")
        or (p.suffix == ".bin" and p.name.split("-")[0] in SPLITS))]


def start(folder: Path, digest: str, *, force: bool) -> Progress:
    """The progress to continue in ``folder`` for arguments hashing to ``digest``: the
    checkpoint of an earlier run with the same arguments, or a fresh one. A folder holding
    anything else is refused unless ``force`` (which removes the files a preparation
    writes). Stale temporary files are removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for tmp in folder.glob(".tmp-*"):
        tmp.unlink()
    progress = None if force else load(folder)
    if progress is not None and progress.args_hash == digest:
        return progress
    if not force and any(folder.iterdir()):
        what = ("was prepared with other arguments" if progress is not None
                else "is not empty and holds no preparation")
        raise ValueError(f"--out: {folder} {what}: use --force to prepare it again "
                         "(its shards, manifest and tokenizer are removed)")
    for path in ours(folder):
        path.unlink()
    return Progress(digest)
