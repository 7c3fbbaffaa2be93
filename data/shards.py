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

from typing import TYPE_CHECKING

import numpy as np
import torch

from traind.contracts.control import write_atomic
from traind.data.fingerprint import content_hash
from traind.data.manifest import (
    DTYPES,
    Manifest,
    ShardEntry,
    read_manifest,
    shard_name,
)

if TYPE_CHECKING:
    from pathlib import Path

NP_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
assert set(NP_DTYPES) == set(DTYPES)


def write_shard(folder: Path, split: str, index: int, ids: np.ndarray, dtype: str
                ) -> ShardEntry:
    """Shard ``index`` of ``split`` holding ``ids`` (1-D), written atomically."""
    arr = np.ascontiguousarray(ids, dtype=NP_DTYPES[dtype])
    if arr.ndim != 1:
        raise ValueError(f"a shard is 1-D token ids, got shape {arr.shape}")
    name = shard_name(split, index)
    data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    write_atomic(folder / name, data)
    return ShardEntry(name, int(arr.size), content_hash(data))


class ShardSet:
    """One split's shards as memory-mapped arrays, sampled as one sequence of window starts.

    ``starts(seq_len)`` counts the windows of ``seq_len + 1`` tokens that fit inside a shard;
    ``windows(offsets, seq_len)`` returns those windows for start numbers in ``[0, starts)``,
    as int64 ``(B, T+1)``: the same contract as a flat token tensor, so one sampler serves both.
    """

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = [a for a in arrays if a.size]
        self.tokens = sum(int(a.size) for a in self.arrays)
        self._cum: dict[int, np.ndarray] = {}

    @classmethod
    def open(cls, folder: Path, split: str, *, manifest: Manifest | None = None,
             verify: bool = False) -> ShardSet:
        """The ``split`` shards of ``folder``. ``verify`` checks each shard's checksum (reads
        every byte once); size mismatches are always errors."""
        manifest = manifest if manifest is not None else read_manifest(folder)
        entries = manifest.splits.get(split)
        if not entries:
            raise ValueError(f"{folder} has no {split!r} shards")
        np_dtype = np.dtype(NP_DTYPES[manifest.dtype]).newbyteorder("<")
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
            arr: np.ndarray = np.memmap(path, dtype=np_dtype, mode="r")
            if verify and content_hash(arr.tobytes()) != e.checksum:
                raise ValueError(f"shard {path} does not match its checksum: prepare the "
                                 "data again")
            arrays.append(arr)
        return cls(arrays)

    def starts(self, seq_len: int) -> int:
        cum = self._cumulative(seq_len)
        return int(cum[-1]) if len(cum) else 0

    def _cumulative(self, seq_len: int) -> np.ndarray:
        """Window starts up to each shard's end, (S,): computed once per ``seq_len``, not at
        every batch the sampler draws."""
        if (cum := self._cum.get(seq_len)) is None:
            per = np.array([max(0, int(a.size) - seq_len) for a in self.arrays], dtype=np.int64)
            cum = self._cum[seq_len] = np.cumsum(per)
        return cum

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
