"""The corpus (filtered, cached), train/val split, and a deterministic, resumable batch sampler.

By default tokens are raw bytes (vocab 256), so there is no tokenizer to train, ship or version;
trainer/tokens.py turns the corpus into BPE ids or reads prepared shards instead. The default
corpus is the Python standard library's own source: it exists on every machine that can run the
trainer, so ``make serve`` trains on something real with no download.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from traind.data.sources import input_files
from traind.trainer.corpus_cache import TIERS, CorpusCache, Document, Tier

if TYPE_CHECKING:
    from pathlib import Path

    from traind.trainer.config import DataConfig

FILTER_REASONS = ("empty", "binary", "too_short", "duplicate")


@dataclass(frozen=True, slots=True)
class Corpus:
    """The assembled corpus and what building it did."""

    data: bytes
    documents: int  # documents that contributed bytes (the last one may be cut at max_bytes)
    filtered: dict[str, int]  # documents dropped, by reason (every reason present)
    cache_hits: dict[str, int]  # per tier (every tier present)
    cache_misses: dict[str, int]
    bounds: tuple[int, ...] = ()  # where each document ends in data (the last is len(data))


def build_corpus(cfg: DataConfig, *, cache: CorpusCache | None = None) -> bytes:
    """The corpus bytes: ``cfg.paths`` (files, or folders searched with ``cfg.glob``) in the
    given order, or the standard library's source when ``paths`` is empty; at most
    ``cfg.max_bytes``. File order is sorted, so the same inputs always give the same bytes.
    Each file is a document; filtered ones are left out (see :func:`load_corpus`)."""
    return load_corpus(cfg, cache=cache).data


def load_corpus(cfg: DataConfig, *, cache: CorpusCache | None = None) -> Corpus:
    """:func:`build_corpus` with its counts. Documents are concatenated as they are (no
    separator), dropping empty, binary, too short (``cfg.min_doc_bytes``) and duplicate ones.
    Files past the ``max_bytes`` cap are not read, so they are neither kept nor counted."""
    cache = cache if cache is not None else CorpusCache(cfg.cache_dir)
    filtered = dict.fromkeys(FILTER_REASONS, 0)
    hits, misses = dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0)
    seen: set[str] = set()
    chunks: list[bytes] = []
    bounds: list[int] = []
    size = 0
    for path in _input_files(cfg):
        if size >= cfg.max_bytes:
            break
        doc, tier = cache.get(path)
        _count_lookup(tier, hits, misses, disk=cache.cache_dir is not None)
        reason = filter_reason(doc, min_bytes=cfg.min_doc_bytes, seen=seen)
        if reason is not None:
            filtered[reason] += 1
            continue
        seen.add(doc.digest)
        chunks.append(doc.data[: cfg.max_bytes - size])
        size += len(chunks[-1])
        bounds.append(size)
    if not chunks:
        dropped = ", ".join(f"{n} {r}" for r, n in filtered.items() if n)
        raise ValueError("data.paths: the corpus is empty"
                         + (f" (documents filtered out: {dropped})" if dropped else ""))
    return Corpus(b"".join(chunks), len(chunks), filtered, hits, misses, tuple(bounds))


def filter_reason(doc: Document, *, min_bytes: int, seen: set[str]) -> str | None:
    """Why ``doc`` is left out of the corpus, or ``None`` to keep it. ``seen`` holds the
    content hashes of the documents kept so far; the first of identical files wins."""
    if doc.reason is not None:
        return doc.reason
    if len(doc.data) < min_bytes:
        return "too_short"
    if doc.digest in seen:
        return "duplicate"
    return None


def _count_lookup(tier: Tier | None, hits: dict[str, int], misses: dict[str, int], *,
                  disk: bool) -> None:
    """A lookup tries memory, then disk (when on): every tier tried before the one that had
    the document missed."""
    for t in TIERS:
        if t == "disk" and not disk:
            return
        if t == tier:
            hits[t] += 1
            return
        misses[t] += 1


def _input_files(cfg: DataConfig) -> list[Path]:
    """The files of the corpus, in corpus order (data/sources.py's listing: the standard
    library's source when ``data.paths`` is empty); a problem names ``data.paths``."""
    try:
        return input_files(cfg.paths, cfg.glob)
    except ValueError as exc:
        raise ValueError(f"data.paths: {exc}") from None


def split_corpus(
    corpus: bytes, val_fraction: float, *, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation byte tensors (uint8, 1-D); validation is the last ``val_fraction``."""
    return split_tokens(torch.frombuffer(bytearray(corpus), dtype=torch.uint8), val_fraction,
                        seq_len=seq_len)


def split_tokens(
    data: torch.Tensor, val_fraction: float, *, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token ids (1-D); validation is the last ``val_fraction``.

    Each split must hold at least one window of ``seq_len + 1`` tokens (inputs plus the shifted
    targets), or there is nothing to sample.
    """
    n_val = int(len(data) * val_fraction)
    train, val = data[: len(data) - n_val], data[len(data) - n_val :]
    need = seq_len + 1
    if len(train) < need or len(val) < need:
        raise ValueError(
            f"data.paths: the corpus ({len(data)} tokens) is too small: train ({len(train)}) "
            f"and validation ({len(val)}) splits each need at least model.seq_len + 1 = "
            f"{need} tokens"
        )
    return train, val


class TokenSource(Protocol):
    """Token ids a sampler draws windows from: ``starts(seq_len)`` windows of ``seq_len + 1``
    ids fit, and ``windows(offsets, seq_len)`` returns those starting at window numbers
    ``offsets`` (B,) as int64 ``(B, T+1)``. A flat tensor (:class:`FlatTokens`) or prepared
    shards (``traind.data.shards.ShardSet``, whose windows never cross a shard's end)."""

    tokens: int

    def starts(self, seq_len: int) -> int: ...

    def windows(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor: ...


class FlatTokens:
    """Token ids in one 1-D tensor (uint8 bytes or int32 BPE ids); window ``k`` starts at
    id ``k``."""

    def __init__(self, ids: torch.Tensor) -> None:
        if ids.dim() != 1:
            raise ValueError(f"token ids are 1-D, got shape {tuple(ids.shape)}")
        self.ids = ids
        self.tokens = len(ids)

    def starts(self, seq_len: int) -> int:
        return max(0, self.tokens - seq_len)

    def windows(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
        idx = offsets[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
        return self.ids[idx].long()  # (B, T+1)


def as_source(data: torch.Tensor | TokenSource) -> TokenSource:
    return FlatTokens(data) if isinstance(data, torch.Tensor) else data


class BatchSampler:
    """Random training windows, reproducible from ``(seed, batch index)`` alone.

    Batch ``i`` comes from a generator seeded with a hash of ``(seed, i)``; it draws offsets for
    the *global* batch (``world_size * batch_size`` windows) and rank ``r`` takes slice ``r``.
    So ranks see disjoint rows of one global batch, and the whole state is the batch index: after
    ``load_state_dict`` the sampler continues exactly where the saved one was.
    """

    def __init__(self, data: torch.Tensor | TokenSource, *, batch_size: int, seq_len: int,
                 seed: int, rank: int = 0, world_size: int = 1, order: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.data = as_source(data)
        if self.data.starts(seq_len) < 1:
            raise ValueError(f"{self.data.tokens} tokens cannot hold a window of {seq_len + 1}")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.order = order  # data.order: which sequence of batches (0: the seed's own)
        self.rank = rank
        self.world_size = world_size
        self.index = 0  # batches drawn so far

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each int64 ``(B, T)``, targets shifted by one byte."""
        gen = torch.Generator().manual_seed(_mix(self.seed, self.index, self.order))
        high = self.data.starts(self.seq_len)  # exclusive: the last window ends at the end
        offsets = torch.randint(0, high, (self.world_size * self.batch_size,), generator=gen)
        mine = offsets[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]  # (B,)
        self.index += 1
        w = self.data.windows(mine, self.seq_len)  # (B, T+1)
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "index": self.index, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state has seed {state['seed']}, this run job.seed "
                             f"{self.seed}")
        # A different world size is allowed (elastic restarts): the batch index still says how
        # far the data order has gone, only the slicing of each global batch changes.
        self.index = int(state["index"])


def _mix(seed: int, index: int, order: int = 0) -> int:
    """A 63-bit generator seed for batch ``index``: hashing avoids correlated nearby seeds.
    Order 0 hashes as it always did, so checkpoints written before ``data.order`` resume into
    the same batches."""
    key = f"{seed}:{index}" if order == 0 else f"{seed}:{order}:{index}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def val_batches(
    data: torch.Tensor | TokenSource, *, batch_size: int, seq_len: int, n_batches: int,
    rank: int = 0, world_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches at evenly spaced offsets (no randomness), so every
    evaluation of every run measures the same tokens. Each is ``(x, y)``, int64 ``(B, T)``.

    ``rank`` of ``world_size``: this share of each batch (its ``batch_size / world_size``
    rows, in order), so that the set is the whole batch's whatever it is split into: a dp
    rank's share of the global batch."""
    if batch_size % world_size:
        raise ValueError(f"a batch of {batch_size} does not split into {world_size} shares")
    source = as_source(data)
    last = source.starts(seq_len) - 1  # the last valid window
    offsets = torch.linspace(0, last, n_batches * batch_size).long()  # (n * B,)
    share = batch_size // world_size
    batches = []
    for chunk in offsets.split(batch_size):
        w = source.windows(chunk[rank * share:(rank + 1) * share], seq_len)  # (B/world, T+1)
        batches.append((w[:, :-1], w[:, 1:]))
    return batches
