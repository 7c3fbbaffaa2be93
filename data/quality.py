"""Quality scores of one document's text, and the rule that turns them into a reason.

Pure functions of plain values: the scores are measured once per document (in a worker
process when ``--workers`` > 1) and the rule compares them with ``data.filter``'s thresholds.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

# Control characters other than \t \n \r (C0, DEL, C1), and U+FFFD, the replacement character
# a lossy decode leaves behind.
_NON_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


@dataclass(frozen=True, slots=True)
class Scores:
    entropy: float  # bits per character
    repetition: float  # share of non-blank lines that repeat an earlier line of the document
    non_text: float  # share of characters that are control characters or U+FFFD


def entropy(text: str) -> float:
    """Shannon entropy of the character distribution, in bits per character (0 when empty)."""
    if not text:
        return 0.0
    n = len(text)
    return max(0.0, -sum(c / n * math.log2(c / n) for c in Counter(text).values()))


def repetition(text: str) -> float:
    """Share of the non-blank lines that are an exact repeat (trailing space aside) of an
    earlier line of the same document."""
    seen: set[str] = set()
    lines = repeats = 0
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        lines += 1
        if line in seen:
            repeats += 1
        else:
            seen.add(line)
    return repeats / lines if lines else 0.0


def non_text(text: str) -> float:
    """Share of characters that are not text: control characters other than tab and the line
    breaks, and U+FFFD."""
    return len(_NON_TEXT.findall(text)) / len(text) if text else 0.0


def score(text: str) -> Scores:
    return Scores(entropy(text), repetition(text), non_text(text))


def quality_reason(s: Scores, *, min_entropy: float, max_repetition: float,
                   max_non_text: float) -> str | None:
    """The quality reason a document with scores ``s`` is left out for, or ``None``. Checked
    in this order (the most specific first): non-text, then low entropy, then repetition.
    A threshold at its "off" value (0, 1, 1) never fires."""
    if max_non_text < 1 and s.non_text > max_non_text:
        return "non_text"
    if min_entropy > 0 and s.entropy < min_entropy:
        return "low_entropy"
    if max_repetition < 1 and s.repetition > max_repetition:
        return "repetitive"
    return None
