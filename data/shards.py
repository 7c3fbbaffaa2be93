"""Token shards: the on-disk format ``traind data prepare`` writes and the trainer reads.

A prepared folder holds, per split (``train``, ``val``), shards named ``<split>-00000.bin``:
raw little-endian token ids, ``uint16`` when the vocabulary fits (<= 65,536 ids) and ``uint32``
otherwise, read back with ``numpy.memmap`` so a trainer touches only the pages its windows
cover (the OS page cache is the shards' cache tier). ``manifest.json`` says what the shards
are: the tokenizer (kind, vocabulary size, content hash, its file beside the shards), the dtype,
each shard's token count and checksum, the documents kept and the filter report.

**Nothing half-written is ever read.** A shard is written to a temporary name, flushed to disk
and renamed into place; the manifest is written last, the same way, so a folder without
``manifest.json`` is a preparation still running or interrupted (``traind data prepare`` resumes
it) and the trainer refuses it with that reason.

A training window never crosses a shard boundary: each shard is its own segment, and window
start ``k`` of the whole split maps to a segment and an offset by the segments' cumulative start
counts. Documents within a shard are separated by the tokenizer's end-of-text id (when it has
one), as GPT-2 and nanoGPT's ``prepare.py`` do.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32-bit shards")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def checksum(data: bytes | memoryview) -> str:
    """The shard checksum the manifest records (blake2b, 128 bits)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class ShardEntry:
    name: str
    tokens: int
    checksum: str


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    kind: str  # "bytes" or "bpe"
    vocab_size: int
    hash: str  # of the tokenizer's definition: shards are only read with the same tokenizer
    file: str | None = None  # the tokenizer.json beside the shards (bpe)
    eos_id: int | None = None  # the id between documents, when the tokenizer has one


@dataclass(frozen=True, slots=True)
class Manifest:
    tokenizer: TokenizerInfo
    dtype: str
    splits: dict[str, list[ShardEntry]]
    documents: dict[str, int] = field(default_factory=dict)  # kept, per split
    report: dict[str, Any] = field(default_factory=dict)  # the filter report (prepare's)
    sources: list[str] = field(default_factory=list)
    version: int = FORMAT_VERSION

    def tokens(self, split: str) -> int:
        return sum(e.tokens for e in self.splits.get(split, []))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any], *, where: str = MANIFEST) -> Manifest:
        try:
            version = raw["version"]
            if version != FORMAT_VERSION:
                raise ValueError(f"format version {version}, this traind reads "
                                 f"{FORMAT_VERSION}: prepare the data again")
            dtype = raw["dtype"]
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
            return cls(
                tokenizer=TokenizerInfo(**raw["tokenizer"]), dtype=dtype,
                splits={s: [ShardEntry(**e) for e in entries]
                        for s, entries in raw["splits"].items()},
                documents={str(k): int(v) for k, v in raw.get("documents", {}).items()},
                report=dict(raw.get("report", {})), sources=list(raw.get("sources", [])),
                version=version)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where} is not a traind shard manifest ({exc!r})") from None


def write_atomic(path: Path, data: bytes | memoryview) -> None:
    """``data`` at ``path``, all or nothing: a temporary file in the same folder, flushed to
    disk, then renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_shard(folder: Path, split: str, index: int, ids: np.ndarray, dtype: str
                ) -> ShardEntry:
    """Shard ``index`` of ``split`` holding ``ids`` (1-D), written atomically."""
    arr = np.ascontiguousarray(ids, dtype=DTYPES[dtype])
    if arr.ndim != 1:
        raise ValueError(f"a shard is 1-D token ids, got shape {arr.shape}")
    name = shard_name(split, index)
    data = memoryview(arr.astype(arr.dtype.newbyteorder("<"), copy=False)).cast("B")
    write_atomic(folder / name, data)
    return ShardEntry(name, int(arr.size), checksum(data))


def write_manifest(folder: Path, manifest: Manifest) -> None:
    write_atomic(folder / MANIFEST, json.dumps(manifest.to_json(), indent=1).encode())


def read_manifest(folder: Path) -> Manifest:
    """The folder's manifest; a clear ``ValueError`` when there is none (unfinished)."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder of prepared shards")
    if not path.is_file():
        raise ValueError(f"{folder} has no {MANIFEST}: its preparation has not finished "
                         "(run traind data prepare again with the same --out to resume it)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    return Manifest.from_json(raw, where=str(path))


class ShardSet:
    """One split's shards as memory-mapped arrays, sampled as one sequence of window starts.

    ``starts(seq_len)`` counts the windows of ``seq_len + 1`` tokens that fit inside a shard;
    ``windows(offsets, seq_len)`` returns those windows for start numbers in ``[0, starts)``,
    as int64 ``(B, T+1)``: the same contract as a flat token tensor, so one sampler serves both.
    """

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = [a for a in arrays if a.size]
        self.tokens = sum(int(a.size) for a in self.arrays)

    @classmethod
    def open(cls, folder: Path, split: str, *, manifest: Manifest | None = None,
             verify: bool = False) -> ShardSet:
        """The ``split`` shards of ``folder``. ``verify`` checks each shard's checksum (reads
        every byte once); size mismatches are always errors."""
        manifest = manifest if manifest is not None else read_manifest(folder)
        entries = manifest.splits.get(split)
        if not entries:
            raise ValueError(f"{folder} has no {split!r} shards")
        np_dtype = np.dtype(DTYPES[manifest.dtype]).newbyteorder("<")
        arrays = []
        for e in entries:
            path = folder / e.name
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise ValueError(f"shard {path} is missing ({exc.strerror})") from None
            if size != e.tokens * np_dtype.itemsize:
                raise ValueError(f"shard {path} holds {size} bytes, the manifest says "
                                 f"{e.tokens} {manifest.dtype} tokens: prepare the data again")
            if e.tokens == 0:
                continue
            arr = np.memmap(path, dtype=np_dtype, mode="r")
            if verify and checksum(memoryview(arr).cast("B")) != e.checksum:
                raise ValueError(f"shard {path} does not match its checksum: prepare the "
                                 "data again")
            arrays.append(arr)
        return cls(arrays)

    def starts(self, seq_len: int) -> int:
        return sum(max(0, int(a.size) - seq_len) for a in self.arrays)

    def _cumulative(self, seq_len: int) -> np.ndarray:
        per = np.array([max(0, int(a.size) - seq_len) for a in self.arrays], dtype=np.int64)
        return np.cumsum(per)  # (S,)

    def windows(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Windows of ``seq_len + 1`` tokens at start numbers ``offsets`` (B,), int64
        ``(B, T+1)``."""
        cum = self._cumulative(seq_len)
        starts = offsets.numpy().astype(np.int64)
        which = np.searchsorted(cum, starts, side="right")  # (B,) the segment of each start
        if len(starts) and (starts.min() < 0 or which.max() >= len(self.arrays)):
            raise IndexError(f"window starts outside [0, {int(cum[-1]) if len(cum) else 0})")
        local = starts - np.concatenate(([0], cum[:-1]))[which]
        out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
        for row, (seg, at) in enumerate(zip(which, local, strict=True)):
            out[row] = self.arrays[seg][at : at + seq_len + 1]
        return torch.from_numpy(out)
