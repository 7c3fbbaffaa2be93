"""The link matrix on /comm: the probe's rank-to-rank bandwidth and latency as a heat map.

Read from the exported gauges (``traind_link_*``, metrics/training.py folds the trainer's
LinkEvent into them), so the page shows what Prometheus scrapes, for as long as the run's
series are kept (metrics/retention.py). Pure: samples in, a view out; the template
(links_panel.html) only lays it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from traind.web.nodeviews import Samples
from traind.web.views import fmt_rate, fmt_seconds

if TYPE_CHECKING:
    from collections.abc import Iterable

    from traind.daemon.service import MetricSample

_BW = "traind_link_bandwidth_bytes_per_second"
_LAT = "traind_link_latency_seconds"
_SECONDS = "traind_link_probe_duration_seconds"


@dataclass(frozen=True, slots=True)
class LinkCell:
    bandwidth: str
    latency: str
    color: str  # CSS background: green for the run's fastest link, red for its slowest (heat)


@dataclass(frozen=True, slots=True)
class LinkMatrix:
    run: str
    ranks: tuple[str, ...]
    rows: tuple[tuple[LinkCell | None, ...], ...]  # [src][dst]; None on the diagonal
    probe: str  # how long the probe took
    spread: str  # fastest / slowest link, e.g. "42x"


# The colour scale spans at least this factor below the fastest link: two loopback links
# measured 3% apart are both green, not one red and one green.
MIN_SPAN = 10.0


def heat(value: float, lo: float, hi: float) -> str:
    """An HSL colour from red (``lo``, or ``hi / MIN_SPAN`` if that is lower) to green
    (``hi``), on a log scale (links differ by orders of magnitude: NVLink, PCIe, the
    network); grey when unknown."""
    if not (math.isfinite(value) and value > 0 and lo > 0):
        return "hsl(0, 0%, 80%)"
    lo = min(lo, hi / MIN_SPAN)
    f = (math.log(value) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return f"hsl({120 * min(1.0, max(0.0, f)):.0f}, 65%, 75%)"


def links_view(samples: Iterable[MetricSample]) -> LinkMatrix | None:
    """The newest run's link matrix (None: no run has probed its links)."""
    s = Samples(samples)
    runs = s.label_values(_BW, "run")  # in numeric order: run 10 after run 9
    if not runs:
        return None
    run = runs[-1]
    # every rank sends and receives: the sources are all the ranks
    ranks = tuple(s.label_values(_BW, "src", run=run))
    bw = {(x.labels["src"], x.labels["dst"]): x.value for x in s.series(_BW, run=run)}
    known = [v for v in bw.values() if math.isfinite(v) and v > 0]
    lo, hi = (min(known), max(known)) if known else (0.0, 0.0)
    rows = tuple(
        tuple(None if src == dst else LinkCell(
            bandwidth=fmt_rate(bw.get((src, dst))),
            latency=fmt_seconds(s.value(_LAT, run=run, src=src, dst=dst)),
            color=heat(bw.get((src, dst), math.nan), lo, hi)) for dst in ranks)
        for src in ranks)
    return LinkMatrix(run, ranks, rows, probe=fmt_seconds(s.value(_SECONDS, run=run)),
                      spread=f"{hi / lo:.1f}x" if known else "-")
