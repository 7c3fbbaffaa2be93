"""Quality scores and the reason rule: tables of cases."""

from __future__ import annotations

import pytest

from traind.data.quality import Scores, entropy, non_text, quality_reason, repetition

OFF = {"min_entropy": 0.0, "max_repetition": 1.0, "max_non_text": 1.0}
DEFAULTS = {"min_entropy": 3.0, "max_repetition": 0.5, "max_non_text": 0.1}


@pytest.mark.parametrize(("text", "bits"), [
    ("", 0.0), ("aaaa", 0.0), ("abab", 1.0), ("abcd", 2.0), ("日本日本", 1.0),
])
def test_entropy(text: str, bits: float) -> None:
    assert entropy(text) == pytest.approx(bits)


@pytest.mark.parametrize(("text", "share"), [
    ("", 0.0),
    ("one\ntwo\nthree", 0.0),
    ("same\nsame\nsame\nsame", 0.75),
    ("a\n\n\n\nb\na", 1 / 3),           # blank lines are not lines
    ("x  \nx\ny", 1 / 3),               # trailing space aside
    ("  x\nx", 0.0),                    # indentation counts
])
def test_repetition(text: str, share: float) -> None:
    assert repetition(text) == pytest.approx(share)


@pytest.mark.parametrize(("text", "share"), [
    ("", 0.0), ("plain\ttext\r\nlines\n", 0.0), ("ab\x00\x01", 0.5),
    ("a\ufffd", 0.5), ("\x7f\x85", 1.0), ("é日", 0.0),
])
def test_non_text(text: str, share: float) -> None:
    assert non_text(text) == pytest.approx(share)


@pytest.mark.parametrize(("scores", "limits", "reason"), [
    (Scores(4.5, 0.1, 0.0), DEFAULTS, None),
    (Scores(2.0, 0.1, 0.0), DEFAULTS, "low_entropy"),
    (Scores(4.5, 0.9, 0.0), DEFAULTS, "repetitive"),
    (Scores(4.5, 0.1, 0.5), DEFAULTS, "non_text"),
    (Scores(0.5, 0.9, 0.5), DEFAULTS, "non_text"),     # the most specific first
    (Scores(0.5, 0.9, 0.0), DEFAULTS, "low_entropy"),
    (Scores(3.0, 0.5, 0.1), DEFAULTS, None),            # at a threshold is kept
    (Scores(0.0, 1.0, 1.0), OFF, None),                 # off never fires
])
def test_quality_reason(scores: Scores, limits: dict[str, float], reason: str | None) -> None:
    assert quality_reason(scores, **limits) == reason
