"""Duplicate filters: exact (a content hash) and near (MinHash signatures of word shingles,
looked up in a MinHash LSH index, datasketch's).

A signature is computed from the text alone (:func:`signature`, a pure function a worker
process can run); the index decides against the documents kept before it, in stream order,
so the first of a family of near-duplicates is the one kept. The whole state pickles: a
resumed ``traind data prepare`` restores it from its last checkpoint instead of re-reading
the documents it skips.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from datasketch import MinHash, MinHashLSH

if TYPE_CHECKING:
    import numpy as np

_WORD = re.compile(r"\w+")
# datasketch's MinHash draws its permutations from this seed: every signature of one run (and
# of a resumed run) must use the same ones.
SEED = 1


def shingles(text: str, words: int) -> set[bytes]:
    """The set of ``words``-word shingles of ``text`` (words: runs of ``\\w``, lower-cased);
    a text shorter than one shingle is one shingle of all its words."""
    tokens = _WORD.findall(text.lower())
    if len(tokens) <= words:
        return {" ".join(tokens).encode()}
    return {" ".join(tokens[i : i + words]).encode() for i in range(len(tokens) - words + 1)}


def signature(text: str, *, words: int, num_perm: int) -> np.ndarray:
    """The MinHash signature (``num_perm`` uint64 values) of ``text``'s word shingles."""
    m = MinHash(num_perm=num_perm, seed=SEED)
    m.update_batch(list(shingles(text, words)))
    return m.hashvalues


class Dedup:
    """What was kept so far: content hashes (exact) and an LSH index of signatures (near).
    ``near=False`` keeps no index (``data.filter.near_duplicates = false``)."""

    def __init__(self, *, near: bool, threshold: float, num_perm: int) -> None:
        self.seen: set[str] = set()
        self.num_perm = num_perm
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm) if near else None
        self.kept = 0  # keys of the index
        self._template = MinHash(num_perm=num_perm, seed=SEED)

    def is_exact(self, digest: str) -> bool:
        return digest in self.seen

    def is_near(self, hashvalues: np.ndarray | None) -> bool:
        """Whether a document with this signature is a near-duplicate of a kept one."""
        if self.lsh is None or hashvalues is None:
            return False
        return bool(self.lsh.query(self._minhash(hashvalues)))

    def keep(self, digest: str, hashvalues: np.ndarray | None) -> None:
        self.seen.add(digest)
        if self.lsh is not None and hashvalues is not None:
            self.lsh.insert(self.kept, self._minhash(hashvalues), check_duplication=False)
            self.kept += 1

    def _minhash(self, hashvalues: np.ndarray) -> MinHash:
        # a copy of a template, not MinHash(hashvalues=...): that needs datasketch 2's
        # ``scheme`` argument, which 1.x does not take
        m = self._template.copy()
        m.hashvalues = hashvalues
        return m
