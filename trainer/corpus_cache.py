"""Per-document filter results, cached in two tiers: an in-process LRU and a folder on disk.

A document's *intrinsic* verdict (empty, binary, or kept with its bytes and content hash) depends
only on the file, so it is cached by ``(path, size, mtime_ns)``. Verdicts that depend on the
config or on other documents (``too_short``, ``duplicate``) are decided when the corpus is
assembled, so one cache serves every ``data.min_doc_bytes`` and every file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from traind.data.fingerprint import content_hash, intrinsic

if TYPE_CHECKING:
    from pathlib import Path

# Bump when classify() changes: disk entries written by an older version then stop matching.
FILTER_VERSION = 1

TIERS = ("memory", "disk")
Tier = Literal["memory", "disk"]
Key = tuple[str, int, int]  # (resolved path, size, mtime_ns)


@dataclass(frozen=True, slots=True)
class Document:
    """One file after the intrinsic filters: ``reason`` is ``"empty"``, ``"binary"`` or
    ``None`` (kept); ``data`` holds the bytes of a kept document only."""

    reason: str | None
    digest: str  # blake2b of the file's bytes: what the duplicate filter compares
    data: bytes = b""


def classify(raw: bytes) -> Document:
    """The intrinsic verdict on a file's bytes (data/fingerprint.intrinsic: empty, binary or
    text), with its content hash."""
    digest = content_hash(raw)
    reason = intrinsic(raw)
    return Document(reason, digest, raw if reason is None else b"")


class CorpusCache:
    """Looks a file's :class:`Document` up in memory, then on disk, then reads and classifies
    it, filling the tiers it missed. ``cache_dir=None`` turns the disk tier off.

    The memory tier holds at most ``memory_bytes`` of document bytes, least recently used out
    first. Disk entries are written to a temporary file and renamed, so a reader never sees a
    half-written one; an entry that does not verify is a miss and is written again. One
    builder at a time: the corpus is assembled on one thread, so there is no lock.
    """

    def __init__(self, cache_dir: Path | None = None, *,
                 memory_bytes: int = 64 * 2**20) -> None:
        if cache_dir is not None:
            if cache_dir.exists() and not cache_dir.is_dir():
                raise ValueError(f"data.cache_dir: {cache_dir} exists and is not a folder")
            cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = cache_dir
        self.memory_bytes = memory_bytes
        self._memory: OrderedDict[Key, Document] = OrderedDict()
        self.memory_held = 0  # bytes of document data in the memory tier
        # A failed write (disk full, read-only folder) must not stop training: the cache is an
        # optimisation, so the failure is counted and the next run simply misses again.
        self.write_errors = 0

    def get(self, path: Path) -> tuple[Document, Tier | None]:
        """The document at ``path`` and the tier that had it (``None``: read from the file)."""
        st = path.stat()
        key: Key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        doc = self._memory.get(key)
        if doc is not None:
            self._memory.move_to_end(key)
            return doc, "memory"
        tier: Tier | None = None
        doc = self._read_disk(key) if self.cache_dir is not None else None
        if doc is not None:
            tier = "disk"
        else:
            doc = classify(path.read_bytes())
            if self.cache_dir is not None:
                self._write_disk(key, doc)
        self._remember(key, doc)
        return doc, tier

    def _remember(self, key: Key, doc: Document) -> None:
        if len(doc.data) > self.memory_bytes:
            return  # would evict everything else and still not fit
        self._memory[key] = doc
        self.memory_held += len(doc.data)
        while self.memory_held > self.memory_bytes:
            _, old = self._memory.popitem(last=False)
            self.memory_held -= len(old.data)

    def _disk_path(self, key: Key) -> Path:
        assert self.cache_dir is not None
        name = content_hash(f"{FILTER_VERSION}\0{key[0]}\0{key[1]}\0{key[2]}".encode())
        return self.cache_dir / f"{name}.doc"

    def _read_disk(self, key: Key) -> Document | None:
        try:
            blob = self._disk_path(key).read_bytes()
        except FileNotFoundError:
            return None
        return decode_entry(blob)

    def _write_disk(self, key: Key, doc: Document) -> None:
        target = self._disk_path(key)
        tmp: str | None = None
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".doc")
            with os.fdopen(fd, "wb") as f:
                f.write(encode_entry(doc))
            os.replace(tmp, target)
        except OSError:
            self.write_errors += 1
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def encode_entry(doc: Document) -> bytes:
    """A disk entry: one JSON header line, then the kept document's bytes."""
    header = {"version": FILTER_VERSION, "reason": doc.reason, "digest": doc.digest,
              "length": len(doc.data)}
    return json.dumps(header).encode() + b"\n" + doc.data


def decode_entry(blob: bytes) -> Document | None:
    """The document in a disk entry, or ``None`` when it is truncated, altered or from
    another filter version (the caller then treats it as a miss)."""
    head, sep, data = blob.partition(b"\n")
    try:
        header = json.loads(head)
        reason, digest, length = header["reason"], header["digest"], header["length"]
        version = header["version"]
    except (ValueError, KeyError, TypeError):
        return None
    if not sep or version != FILTER_VERSION or length != len(data):
        return None
    if reason not in (None, "empty", "binary") or not isinstance(digest, str):
        return None
    if reason is not None and data:
        return None
    if reason is None and content_hash(data) != digest:
        return None
    return Document(reason, digest, data)
