"""A prepared folder's manifest: what its token shards are (data/shards.py has the format).

Kept apart from the shards' reader so the daemon can read a manifest (the vocabulary a run's
model needs, the filter report) without importing numpy's memmaps or torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from traind.contracts.control import write_atomic

if TYPE_CHECKING:
    from pathlib import Path

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32-bit shards")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


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


