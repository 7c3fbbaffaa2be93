"""A run's data as its page shows it: what it trains on, what each filter removed, and how
its data cache's tiers served the loop (the summary's ``data``: daemon/runs/summary.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traind.web.views import fmt_bytes, fmt_count, fmt_percent, fmt_seconds

# How the page names each cache tier (trainer/tiers.py), nearest the step first.
TIER_LABELS = {"device": "device (tier 1)", "host": "host ring (tier 2)",
               "page_cache": "page cache (tier 3)"}


@dataclass(frozen=True, slots=True)
class FilterRow:
    reason: str
    documents: str
    size: str  # bytes removed; a dash where the corpus read at start does not count them
    tokens: str  # tokens removed (likewise)


@dataclass(frozen=True, slots=True)
class TierRow:
    tier: str
    hit_rate: str
    requests: str
    wait: str


@dataclass(frozen=True, slots=True)
class DataView:
    tokens: str
    documents: str
    wait: str  # the loop's wait for batches, all told
    filters: tuple[FilterRow, ...]  # reasons that removed anything
    tiers: tuple[TierRow, ...]


def data_view(v: Any) -> DataView | None:
    """The summary's data figures for the page; None before the first data report."""
    if not isinstance(v, dict):
        return None
    filters = tuple(
        FilterRow(reason, fmt_count(f.get("documents")), fmt_bytes(f.get("bytes")),
                  fmt_count(f.get("tokens")))
        for reason, f in (v.get("filtered") or {}).items() if f.get("documents"))
    tiers = []
    for tier, t in (v.get("tiers") or {}).items():
        asked = t.get("hits", 0) + t.get("misses", 0)
        tiers.append(TierRow(TIER_LABELS.get(tier, tier),
                             fmt_percent(t["hits"] / asked if asked else None),
                             fmt_count(asked), fmt_seconds(t.get("wait_seconds"))))
    return DataView(fmt_count(v.get("tokens")), fmt_count(v.get("documents")),
                    fmt_seconds(v.get("wait_seconds")), filters, tuple(tiers))
