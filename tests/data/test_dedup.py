"""Exact and near-duplicate detection, and the filter chain's reasons on the planted corpus."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

from tests.data.conftest import PLANTED, near_copy, real_doc
from traind.data.dedup import Dedup, shingles, signature
from traind.data.filters import REASONS, DocFilter, analyse
from traind.trainer.config import FilterConfig

if TYPE_CHECKING:
    from pathlib import Path


def test_shingles() -> None:
    assert shingles("A b c", 5) == {b"a b c"}
    assert shingles("a b c d", 2) == {b"a b", b"b c", b"c d"}


def test_near_copy_is_found_and_a_different_text_is_not() -> None:
    dedup = Dedup(near=True, threshold=0.8, num_perm=128)
    sig = signature(real_doc(0), words=5, num_perm=128)
    dedup.keep("d0", sig)
    assert dedup.is_near(signature(near_copy(real_doc(0)), words=5, num_perm=128))
    assert not dedup.is_near(signature(real_doc(1), words=5, num_perm=128))
    assert dedup.is_exact("d0") and not dedup.is_exact("d1")
    again = pickle.loads(pickle.dumps(dedup))  # the checkpoint's round trip keeps the index
    assert again.is_near(signature(near_copy(real_doc(0)), words=5, num_perm=128))


def test_near_duplicates_off_keeps_no_index() -> None:
    dedup = Dedup(near=False, threshold=0.8, num_perm=128)
    dedup.keep("d0", None)
    assert dedup.lsh is None and not dedup.is_near(None)


def test_every_planted_document_is_caught_with_its_reason(corpus: tuple[Path, list[str]]
                                                          ) -> None:
    folder, _ = corpus
    f = DocFilter(FilterConfig(), min_doc_bytes=16)
    reasons = {}
    for path in sorted(folder.iterdir()):
        a = analyse(path.read_bytes(), shingle_words=5, num_perm=f.num_perm)
        reasons[path.name] = f.decide(a)
    assert {n: r for n, r in reasons.items() if n.startswith("x-")} == {
        n: r for n, (_, r) in PLANTED.items()}
    assert all(r is None for n, r in reasons.items() if n.startswith("doc-"))
    assert set(reasons.values()) - {None} <= set(REASONS)
