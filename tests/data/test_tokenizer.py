"""The byte tokenizer and a byte-level BPE trained locally."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.data.conftest import real_doc
from traind.data.tokenizer import (
    EOS,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    train_bpe,
)

if TYPE_CHECKING:
    from pathlib import Path

TEXTS = [real_doc(i) for i in range(20)]
ODD = "naïve café, 東京 データ — emoji 🚀 and tabs\tand\r\nbreaks \x00 never seen"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe(TEXTS, 400)


def test_bytes_are_the_utf8_bytes() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.eos_id is None
    assert tok.encode_batch(["aé"]) == [[97, 0xC3, 0xA9]]
    assert tok.decode(tok.encode_batch([ODD])[0]) == ODD
    assert [a.tolist() for a in tok.encode_arrays(["aé".encode()])] == [[97, 0xC3, 0xA9]]
    assert tok.info().kind == "bytes" and tok.hash == ByteTokenizer().hash


def test_bpe_round_trips_any_text_and_honours_the_vocabulary(bpe: BPETokenizer) -> None:
    assert bpe.vocab_size == 400 and bpe.eos_id == bpe.tok.token_to_id(EOS)
    for text in [*TEXTS[:3], ODD, ""]:
        ids = bpe.encode_batch([text])[0]
        assert bpe.decode(ids) == text
        assert all(0 <= i < 400 for i in ids)
    assert len(bpe.encode_batch([TEXTS[0]])[0]) < len(TEXTS[0].encode()) / 2  # merges learnt
    assert [a.tolist() for a in bpe.encode_arrays([ODD.encode()])] == bpe.encode_batch([ODD])


def test_bpe_hash_is_stable_across_save_and_load(bpe: BPETokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path / "tokenizer.json")
    again = load_tokenizer("bpe", tmp_path / "tokenizer.json")
    assert again.hash == bpe.hash and again.vocab_size == bpe.vocab_size
    assert train_bpe(TEXTS, 400).hash == bpe.hash  # training is deterministic
    assert train_bpe(TEXTS, 300).hash != bpe.hash
    info = again.info("tokenizer.json")
    assert (info.kind, info.file, info.eos_id) == ("bpe", "tokenizer.json", bpe.eos_id)


@pytest.mark.parametrize("content", [None, b"", b"{not json", b'{"model": 3}'])
def test_a_missing_or_garbage_file_is_a_clear_error(tmp_path: Path, content: bytes | None
                                                    ) -> None:
    path = tmp_path / "tok.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"tok\.json: not a usable tokenizer\.json"):
        BPETokenizer.from_file(path)


def test_load_tokenizer_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"data\.tokenizer_file"):
        load_tokenizer("bpe", None)
    with pytest.raises(ValueError, match=r"data\.tokenizer: 'words'"):
        load_tokenizer("words")
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(TEXTS, 100)
