"""The vocabulary a run's model needs: the tokenizer's, read before the model is built.

torch-free (the daemon calls it for every run's config, and its start-up imports no torch): it
reads the shards' manifest or the tokenizer's file, never the token ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traind.data.manifest import read_manifest
from traind.errors import FieldErrors

if TYPE_CHECKING:
    from traind.data.tokenizer import Tokenizer
    from traind.trainer.config import DataConfig, TrainConfig

BYTES_VOCAB = 256


def data_vocab(cfg: DataConfig) -> int:
    """The vocabulary the data's token ids come from: the shards' tokenizer, the BPE file's,
    or the 256 byte values. A missing or unreadable file is a ``FieldErrors`` naming its
    field."""
    if cfg.shards is not None:
        try:
            return read_manifest(cfg.shards).tokenizer.vocab_size
        except ValueError as exc:
            raise FieldErrors.at(("data", "shards"), str(exc)) from None
    if cfg.tokenizer == "bpe":
        return bpe_tokenizer(cfg).vocab_size
    return BYTES_VOCAB


def fit_vocab(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``model.vocab_size`` raised to the data's vocabulary when smaller. A larger
    one is kept: the extra rows are padding (nanoGPT's 50,304 for GPT-2's 50,257), which some
    shapes want for their matmuls."""
    vocab = data_vocab(cfg.data)
    if cfg.model.vocab_size >= vocab:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab})})


def bpe_tokenizer(cfg: DataConfig) -> Tokenizer:
    """``data.tokenizer_file``'s BPE tokenizer (a ``FieldErrors`` naming it if unusable)."""
    from traind.data.tokenizer import load_tokenizer

    return load_tokenizer("bpe", cfg.tokenizer_file)
