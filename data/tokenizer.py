"""Tokenizers, selected by name (``data.tokenizer``): raw UTF-8 bytes, or a byte-level BPE
(Hugging Face ``tokenizers``) trained locally or read from a ``tokenizer.json``. Never
downloaded.

``hash`` identifies the tokenizer's definition: shards are only ever read back with the
tokenizer that wrote them (the manifest records it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from traind.contracts.control import write_atomic
from traind.data.fingerprint import content_hash
from traind.data.manifest import TokenizerInfo
from traind.errors import FieldErrors

if TYPE_CHECKING:
    from collections.abc import Iterable

    from tokenizers import Tokenizer as HFTokenizer

EOS = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
KINDS = ("bytes", "bpe")


class Tokenizer(ABC):
    """The base: what prepare and the trainer need of a tokenizer."""

    kind: ClassVar[str]
    vocab_size: int
    eos_id: int | None = None  # the id written after each document, when there is one
    hash: str

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_arrays(self, docs: list[bytes]) -> list[np.ndarray]:
        """Token ids of UTF-8 documents, one array each (the fast path prepare uses)."""
        return [np.asarray(ids, dtype=np.int64)
                for ids in self.encode_batch([d.decode("utf-8") for d in docs])]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @abstractmethod
    def save(self, path: Path) -> None: ...

    def info(self, file: str | None = None) -> TokenizerInfo:
        return TokenizerInfo(self.kind, self.vocab_size, self.hash, file, self.eos_id)


class ByteTokenizer(Tokenizer):
    """Raw UTF-8 bytes: 256 ids, no separator between documents."""

    kind = "bytes"
    vocab_size = 256
    hash = content_hash(b"traind bytes tokenizer v1: utf-8 bytes, vocab 256, no eos")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_arrays(self, docs: list[bytes]) -> list[np.ndarray]:
        # a view of the bytes themselves: nothing to compute, so no pool either
        return [np.frombuffer(d, dtype=np.uint8) for d in docs]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def save(self, path: Path) -> None:
        raise ValueError("the bytes tokenizer has no file to save")


class BPETokenizer(Tokenizer):
    """A byte-level BPE (``tokenizers``), with ``<|endoftext|>`` between documents."""

    kind = "bpe"

    def __init__(self, tok: HFTokenizer) -> None:
        eos = tok.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"the tokenizer has no {EOS} token")
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = eos
        self.hash = content_hash(tok.to_str().encode())

    @classmethod
    def from_file(cls, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises a bare Exception
            reason = "does not exist" if not Path(path).is_file() else str(exc)
            raise ValueError(f"{path}: not a usable tokenizer.json ({reason})") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: Path) -> None:
        write_atomic(path, self.tok.to_str().encode())


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2
              ) -> BPETokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts``: the 256 byte
    symbols are always in it, so any text round-trips."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"a byte-level BPE needs at least 257 ids (256 bytes and {EOS}), "
                         f"not {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(kind: str, file: Path | None = None) -> Tokenizer:
    """``data.tokenizer`` (and ``data.tokenizer_file``) as a tokenizer; a ``FieldErrors``
    naming the field that cannot be used."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        raise FieldErrors.at(("data", "tokenizer"), f"{kind!r} is not one of "
                             f"{', '.join(KINDS)}")
    if file is None:
        raise FieldErrors.at(("data", "tokenizer_file"), "data.tokenizer = bpe needs a "
                             "tokenizer.json (traind data tokenizer train makes one)")
    try:
        return BPETokenizer.from_file(file)
    except ValueError as exc:
        raise FieldErrors.at(("data", "tokenizer_file"), str(exc)) from None
