"""prepare(): manifest and shards that hold exactly the kept documents' tokens, the report,
and resuming an interrupted run to the same bytes."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests.data.conftest import PLANTED, near_copy, real_doc, write_corpus
from traind.data import prepare as prepare_mod
from traind.data.filters import REASONS
from traind.data.fingerprint import content_hash as digest
from traind.data.manifest import MANIFEST
from traind.data.prepare import is_val, prepare
from traind.data.shards import ShardSet
from traind.data.tokenizer import ByteTokenizer, Tokenizer, train_bpe
from traind.trainer.config import FilterConfig

if TYPE_CHECKING:
    from pathlib import Path

    from traind.data.progress import Progress


class Interrupt(Exception):
    pass


def run(corpus: Path, out: Path, tok: Tokenizer | None = None, **kw: object) -> object:
    args: dict = {"tokenizer": tok or ByteTokenizer(), "filter_cfg": FilterConfig(),
                  "val_fraction": 0.2, "shard_tokens": 1500, "glob": "*.txt"}
    return prepare([corpus], out, **(args | kw))


def expected(texts: list[str], tok: Tokenizer, split: str) -> list[int]:
    ids: list[int] = []
    for text in texts:
        if is_val(digest(text.encode()), 0.2) == (split == "val"):
            ids += tok.encode_batch([text])[0] + ([] if tok.eos_id is None else [tok.eos_id])
    return ids


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_shards_hold_the_kept_documents_tokens(corpus: tuple[Path, list[str]],
                                               tmp_path: Path, kind: str) -> None:
    folder, texts = corpus
    tok = ByteTokenizer() if kind == "bytes" else train_bpe(texts, 300)
    m = run(folder, tmp_path / "out", tok)
    kept = texts  # every real document (the planted copies come after their originals)
    for split in ("train", "val"):
        got = np.concatenate(ShardSet.open(tmp_path / "out", split, verify=True).arrays)
        assert got.tolist() == expected(kept, tok, split)
        assert m.tokens(split) == len(got) == m.report["kept"][split]["tokens"]
    assert m.documents["val"] > 0 and m.documents["train"] + m.documents["val"] == len(texts)
    assert {r: n["documents"] for r, n in m.report["removed"].items() if n["documents"]} == {
        r: 1 for _, r in PLANTED.values()}
    assert set(m.report["removed"]) == set(REASONS)
    for reason in ("near_duplicate", "low_entropy", "repetitive"):  # tokens of what was left out
        removed = m.report["removed"][reason]
        assert 0 < removed["tokens"] <= removed["bytes"], (reason, removed)
        if kind == "bytes":
            assert removed["tokens"] == removed["bytes"]
    assert m.report["read"]["documents"] == len(texts) + len(PLANTED)
    assert m.tokenizer.hash == tok.hash and m.dtype == "uint16"
    assert (m.tokenizer.file is None) == (kind == "bytes")
    if kind == "bpe":
        assert (tmp_path / "out" / "tokenizer.json").is_file() and m.tokenizer.eos_id is not None
    assert len(m.splits["train"]) > 1  # several shards: 1500 tokens each but the last


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*-*.bin"))}


def manifest_sans_timings(out: Path) -> dict:
    raw = json.loads((out / MANIFEST).read_text())
    raw["report"].pop("timings")
    return raw


def test_an_interrupted_run_resumes_to_the_same_bytes(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 4)
    corpus = tmp_path / "corpus"
    texts = write_corpus(corpus)
    # near-duplicates of the first documents late in the stream: the resumed run must still
    # know (its restored dedup state) that they are copies
    (corpus / "z-late.txt").write_text(near_copy(real_doc(2)))
    (corpus / "z-late2.txt").write_text(texts[3])
    whole = run(corpus, tmp_path / "whole")
    seen: list[int] = []

    def stop(progress: Progress) -> None:
        assert not (tmp_path / "cut" / MANIFEST).exists()  # nothing a trainer would read
        seen.append(progress.position)
        raise Interrupt

    with pytest.raises(Interrupt):
        run(corpus, tmp_path / "cut", on_checkpoint=stop)
    assert 0 < seen[0] < len(texts) and not (tmp_path / "cut" / MANIFEST).exists()
    (tmp_path / "cut" / ".tmp-stale.bin").write_bytes(b"half")
    resumed = run(corpus, tmp_path / "cut")
    assert not (tmp_path / "cut" / ".tmp-stale.bin").exists()
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")
    assert manifest_sans_timings(tmp_path / "cut") == manifest_sans_timings(tmp_path / "whole")
    assert resumed.report["removed"]["near_duplicate"]["documents"] == 2
    assert resumed.report["removed"]["duplicate"]["documents"] == 2
    assert whole.splits == resumed.splits


def test_other_arguments_are_refused_without_force(corpus: tuple[Path, list[str]],
                                                   tmp_path: Path) -> None:
    folder, _ = corpus
    out = tmp_path / "out"
    first = run(folder, out)
    assert run(folder, out) == first  # the same command again: done already
    with pytest.raises(ValueError, match="prepared with other arguments: use --force"):
        run(folder, out, val_fraction=0.3)
    again = run(folder, out, val_fraction=0.3, force=True)
    assert again.documents != first.documents
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty and holds no preparation"):
        run(folder, tmp_path / "other")


def test_a_bpe_is_trained_on_the_sources_when_asked(corpus: tuple[Path, list[str]],
                                                    tmp_path: Path) -> None:
    folder, _ = corpus
    m = prepare([folder], tmp_path / "out", tokenizer=None, train_vocab=300,
                filter_cfg=FilterConfig(), val_fraction=0.2, glob="*.txt")
    assert m.tokenizer.kind == "bpe" and m.tokenizer.vocab_size <= 300
    with pytest.raises(ValueError, match="--vocab"):
        prepare([folder], tmp_path / "x", filter_cfg=FilterConfig())


def test_jsonl_documents_and_an_empty_split(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": real_doc(i)}) + "\n" for i in range(20)))
    m = prepare([path], tmp_path / "out", tokenizer=ByteTokenizer(), filter_cfg=FilterConfig(),
                val_fraction=0.2)
    assert m.documents["train"] + m.documents["val"] == 20
    with pytest.raises(ValueError, match="the val split is empty"):
        prepare([path], tmp_path / "few", tokenizer=ByteTokenizer(),
                filter_cfg=FilterConfig(), val_fraction=0.001)


def test_what_cannot_make_two_splits_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    """Issue 40: one big file (one document) failed after 68 s and 420 MB of shards with
    "the val split is empty", which its size told before the start."""
    one = tmp_path / "one.txt"
    one.write_text(real_doc(1, words=2000))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"1 document .* would be empty"):
        prepare([one], out, tokenizer=ByteTokenizer(), filter_cfg=FilterConfig())
    assert not out.exists() or not any(out.iterdir())
    # read in pieces it is enough documents: the same file, cut at 1 KiB, prepares
    m = prepare([one], out, tokenizer=ByteTokenizer(), filter_cfg=FilterConfig(),
                val_fraction=0.3, max_doc_bytes=1024, min_doc_bytes=1)
    assert m.documents["train"] >= 1 and m.documents["val"] >= 1


def test_a_failed_preparation_names_the_filter_and_removes_what_it_wrote(
        tmp_path: Path) -> None:
    """Issue 40: binary files said only "the train split is empty", and the shards of a
    failed run stayed on disk."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for i in range(30):
        (folder / f"b{i}.txt").write_bytes(bytes(range(256)) * (i + 2))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"all 30 documents read were dropped: 30 by the "
                                         r"binary filter .*removed the 1 file it wrote"):
        prepare([folder], out, tokenizer=ByteTokenizer(), filter_cfg=FilterConfig(),
                glob="*.txt")
    assert list(out.iterdir()) == []
    # an empty val split after shards were written: they go too
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": real_doc(i)}) + "\n" for i in range(20)))
    few = tmp_path / "few"
    with pytest.raises(ValueError, match=r"the val split is empty \(20 documents kept of 20 "
                                         r"read\).*removed the \d+ files it wrote"):
        prepare([path], few, tokenizer=ByteTokenizer(), filter_cfg=FilterConfig(),
                val_fraction=0.001, shard_tokens=1000)
    assert list(few.iterdir()) == []


@pytest.mark.parametrize(("removed", "kept_tokens", "kept_bytes", "expected"), [
    (1000, 5000, 5000, 1000),  # the bytes tokenizer: a token a byte, exactly
    (1000, 1000, 4000, 250),  # a BPE at 4 bytes a token
    (999, 1, 2, 500),  # rounded to the nearest token
    (1000, 0, 0, 1000),  # nothing kept: a byte a token
])
def test_removed_tokens_are_estimated_at_the_kept_documents_rate(
        removed: int, kept_tokens: int, kept_bytes: int, expected: int) -> None:
    """Issue 41: every removed document was tokenized to count it (115.5M tokens of removed
    binaries against 17.3M kept); the report estimates them, and says so."""
    from traind.data.prepare import REMOVED_TOKENS, estimated_tokens

    assert estimated_tokens(removed, kept_tokens, kept_bytes) == expected
    assert "estimated" in REMOVED_TOKENS
