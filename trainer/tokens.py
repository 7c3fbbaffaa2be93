"""What a run trains on, as token ids: the byte corpus, the corpus through a BPE tokenizer, or
the shards ``traind data prepare`` wrote (``data.shards``).

Each becomes two :class:`TokenSource` splits with one contract, ``starts(seq_len)`` and
``windows(offsets, seq_len)``, so the one deterministic, resumable sampler
(``trainer/data.BatchSampler``) and the fixed validation batches serve all three. The model's
vocabulary follows the tokenizer (trainer/vocab.py), decided before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np
import torch

from traind.data.manifest import Manifest, read_manifest
from traind.data.shards import ShardSet
from traind.errors import FieldErrors
from traind.trainer.data import Corpus, FlatTokens, TokenSource, load_corpus, split_tokens
from traind.trainer.vocab import BYTES_VOCAB, bpe_tokenizer

if TYPE_CHECKING:
    from traind.data.tokenizer import Tokenizer
    from traind.trainer.config import DataConfig
    from traind.trainer.corpus_cache import CorpusCache


@dataclass(frozen=True, slots=True)
class Tokens:
    """A run's training and validation tokens, and what building them left out."""

    train: TokenSource
    val: TokenSource
    tokenizer: str  # bytes | bpe
    vocab_size: int
    documents: int
    filtered: dict[str, int]  # documents left out, per reason
    filtered_bytes: dict[str, int] = field(default_factory=dict)  # prepared shards only
    filtered_tokens: dict[str, int] = field(default_factory=dict)  # prepared shards only
    corpus: Corpus | None = None  # read at start (None: prepared shards)

    @property
    def tokens_kept(self) -> int:
        return self.train.tokens + self.val.tokens


def load_tokens(cfg: DataConfig, *, seq_len: int, cache: CorpusCache | None = None) -> Tokens:
    """The run's splits, from the shards when ``data.shards`` is set, else from the corpus
    (read, filtered and cached as before) through the configured tokenizer."""
    if cfg.shards is not None:
        return _from_shards(cfg, seq_len)
    corpus = load_corpus(cfg, cache=cache)
    if cfg.tokenizer == "bpe":
        tok = bpe_tokenizer(cfg)
        ids = torch.from_numpy(encode_documents(corpus, tok))
        vocab = tok.vocab_size
    else:
        ids = torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)  # (N,)
        vocab = BYTES_VOCAB
    train, val = split_tokens(ids, cfg.val_fraction, seq_len=seq_len)
    return Tokens(FlatTokens(train), FlatTokens(val), cfg.tokenizer, vocab, corpus.documents,
                  dict(corpus.filtered), corpus=corpus)


def encode_documents(corpus: Corpus, tok: Tokenizer) -> np.ndarray:
    """The corpus's documents through ``tok``, each followed by its end-of-text id (when it
    has one), as one int32 array."""
    texts = [corpus.data[a:b].decode("utf-8", errors="replace")
             for a, b in pairwise((0, *corpus.bounds))]
    eos = [] if tok.eos_id is None else [tok.eos_id]
    ids = [np.asarray(doc + eos, dtype=np.int32) for doc in tok.encode_batch(texts)]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)


def _from_shards(cfg: DataConfig, seq_len: int) -> Tokens:
    assert cfg.shards is not None
    try:
        manifest = read_manifest(cfg.shards)
        train, val = (ShardSet.open(cfg.shards, s, manifest=manifest) for s in ("train", "val"))
    except ValueError as exc:
        raise FieldErrors.at(("data", "shards"), str(exc)) from None
    for name, split in (("train", train), ("val", val)):
        if split.starts(seq_len) < 1:
            raise FieldErrors.at(("data", "shards"), f"the {name} split of {cfg.shards} has "
                                 f"no shard of more than model.seq_len = {seq_len} tokens")
    return Tokens(train, val, manifest.tokenizer.kind, manifest.tokenizer.vocab_size,
                  sum(manifest.documents.values()), *report_counts(manifest))


def report_counts(manifest: Manifest) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Documents, bytes and tokens each filter removed, per reason, from a manifest's report
    (``{"removed": {reason: {"documents": n, "bytes": n, "tokens": n}}}``, data/prepare.py)."""
    removed = manifest.report.get("removed", {})
    docs, size, tokens = ({str(r): int(v.get(key, 0)) for r, v in removed.items()}
                          for key in ("documents", "bytes", "tokens"))
    return docs, size, tokens
