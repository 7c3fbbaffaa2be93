"""A planted corpus: real-looking documents and one of each kind of junk the filters catch."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

WORDS = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda",
    "sigma", "omega", "river", "stone", "cloud", "forest", "signal", "vector", "tensor",
    "kernel", "shard", "token", "batch", "window", "order", "seed", "queue", "lock",
    "metric", "trace", "probe", "graph", "layer", "weight", "gradient", "learning",
    "schedule", "rank", "résumé", "naïve", "café", "東京", "データ",
)


def real_doc(seed: int, words: int = 240) -> str:
    """Random words over many lines: high entropy, no repeated lines, unlike any other seed."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(words // 12)]
    return "\n".join(f"{i}: {line}" for i, line in enumerate(out)) + "\n"


def near_copy(text: str) -> str:
    """``text`` with two words changed: a near-duplicate at 5-word shingles."""
    words = text.split(" ")
    words[10], words[120] = "CHANGED", "EDITED"
    return " ".join(words)


PLANTED = {  # file name -> (bytes, the reason it is dropped)
    "x-near.txt": (near_copy(real_doc(0)).encode(), "near_duplicate"),
    "x-exact.txt": (real_doc(1).encode(), "duplicate"),
    "x-aaaa.txt": (b"a" * 3000, "low_entropy"),
    "x-lines.txt": (b"def handler(request, response): return process(request.body, 42)\n"
                    * 100, "repetitive"),
    "x-control.txt": (("".join(chr(c) for c in range(1, 9)) * 40 + real_doc(99)).encode(),
                      "non_text"),
    "x-binary.txt": (b"\x00\x01\x02 binary data" * 10, "binary"),
    "x-empty.txt": (b"", "empty"),
    "x-short.txt": (b"hi", "too_short"),
}


def write_corpus(folder: Path, real: int = 30) -> list[str]:
    """``real`` real documents (``doc-00.txt``...) then the planted ones (``x-*.txt``, sorted
    after them); the real documents' texts, in corpus order."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [real_doc(i) for i in range(real)]
    for i, text in enumerate(texts):
        (folder / f"doc-{i:02d}.txt").write_text(text)
    for name, (data, _) in PLANTED.items():
        (folder / name).write_bytes(data)
    return texts


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    folder = tmp_path / "corpus"
    return folder, write_corpus(folder)
