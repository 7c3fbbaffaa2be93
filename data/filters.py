"""What ``traind data prepare`` leaves out, and why: one reason per dropped document.

Each document is first *analysed* (:func:`analyse`: a pure function of its bytes, run in
worker processes when there are several), then *decided* (:class:`DocFilter`) in stream order
against what was kept before it. The thresholds are ``data.filter`` (trainer/config.py's
``FilterConfig``, imported for its type only: this package imports nothing of the trainer's
at run time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from traind.data.dedup import Dedup, signature
from traind.data.fingerprint import content_hash, intrinsic
from traind.data.quality import Scores, quality_reason, score

if TYPE_CHECKING:
    import numpy as np

    from traind.trainer.config import FilterConfig

# Every reason a document is left out for, in the order they are checked.
REASONS = ("empty", "binary", "too_short", "duplicate", "non_text", "low_entropy",
           "repetitive", "near_duplicate")


@dataclass(frozen=True, slots=True)
class Analysis:
    """One document's intrinsic facts: what the decision needs, nothing of the others."""

    size: int  # bytes
    digest: str  # blake2b-128 of the bytes: exact duplicates, and the val split
    reason: str | None  # intrinsic: "empty", "binary" or None
    scores: Scores | None = None
    hashvalues: np.ndarray | None = None  # the MinHash signature (near_duplicates on)


def analyse(raw: bytes, *, shingle_words: int, num_perm: int | None) -> Analysis:
    """Everything about ``raw`` that depends on it alone; ``num_perm=None``: no signature."""
    reason = intrinsic(raw)
    if reason is not None:
        return Analysis(len(raw), content_hash(raw), reason)
    text = raw.decode("utf-8")
    sig = None if num_perm is None else signature(text, words=shingle_words, num_perm=num_perm)
    return Analysis(len(raw), content_hash(raw), None, score(text), sig)


class DocFilter:
    """Decides documents in stream order; its state (the dedup index) pickles."""

    def __init__(self, cfg: FilterConfig, *, min_doc_bytes: int) -> None:
        self.cfg = cfg
        self.min_doc_bytes = min_doc_bytes
        self.dedup = Dedup(near=cfg.near_duplicates, threshold=cfg.near_threshold,
                           num_perm=cfg.num_perm)

    @property
    def num_perm(self) -> int | None:
        return self.cfg.num_perm if self.cfg.near_duplicates else None

    def decide(self, a: Analysis) -> str | None:
        """The reason ``a`` is left out, or ``None``: then it is kept and remembered."""
        reason = a.reason
        if reason is None and a.size < self.min_doc_bytes:
            reason = "too_short"
        if reason is None and self.dedup.is_exact(a.digest):
            reason = "duplicate"
        if reason is None and a.scores is not None:
            reason = quality_reason(a.scores, min_entropy=self.cfg.min_entropy,
                                    max_repetition=self.cfg.max_repetition,
                                    max_non_text=self.cfg.max_non_text)
        if reason is None and self.dedup.is_near(a.hashvalues):
            reason = "near_duplicate"
        if reason is None:
            self.dedup.keep(a.digest, a.hashvalues)
        return reason
