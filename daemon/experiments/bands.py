"""The "no difference" band an experiment gets when its spec leaves it to the node.

A fixed band (the old ±2%) is tighter than this machine's noise allows within any budget a
user would wait for: an A/A then never ends "no difference", only "inconclusive (budget
spent)" (issue 14). So ``equivalence`` may be left out (``None``): the band is then the
narrowest one the experiment's own budget reaches at the noise this node measured
(``stats.reachable_band``): the per-pair noise recorded by the newest done interleaved
experiment (its noisiest arm), else ``stats.DEFAULT_PAIR_NOISE``. It is fixed at submission,
before any of the experiment's own data, so choosing it does not bias the test; the experiment
stores the band and how it was chosen, and the pages say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from traind.daemon.experiments import stats

if TYPE_CHECKING:
    from collections.abc import Iterable

    from traind.daemon.service import ExperimentInfo, ExperimentSpec


@dataclass(frozen=True, slots=True)
class Noise:
    """Per-pair noise (sd of the log throughput ratios) and where it was measured: the
    experiments (newest first) and the pairs pooled; none: not measured, the default."""

    value: float
    experiments: tuple[int, ...] = ()
    pairs: int = 0

    def describe(self) -> str:
        pct = f"{round(self.value * 100, 1):g}%"
        if not self.experiments:
            return f"{pct} per pair (assumed: this node has measured none yet)"
        ids = self.experiments
        which = f"experiment {ids[0]}" if len(ids) == 1 else \
            f"{len(ids)} experiments, the newest {ids[0]}"
        return f"{pct} per pair, measured over {self.pairs} pairs by {which}"


# The evidence pooled for a node's noise. One experiment is not enough: on this machine the
# robust noise of 30 real A/As ranged 0.012-0.18 per pair as the load changed, and one decided
# early reads low (it stopped because its pairs agreed: 6-7 pairs gave 0.012-0.03). So the
# figure is the root mean square over the newest POOL_EXPERIMENTS done interleaved
# experiments' arms, each weighted by its pairs (the noisy ones weigh in), once they hold
# MIN_NOISE_PAIRS pairs in all.
POOL_EXPERIMENTS = 10
MIN_NOISE_PAIRS = 16


def measured_noise(infos: Iterable[ExperimentInfo]) -> Noise | None:
    """The node's per-pair noise from its newest done interleaved experiments (``infos``
    newest first), as the comment above says; None when they hold too few pairs."""
    squares, pairs, ids = 0.0, 0, []
    for info in infos:
        if info.mode != "interleaved" or info.state != "done":
            continue
        arms = [(float(v["noise"]), int(v["pairs"])) for v in (info.verdict or {}).values()
                if isinstance(v, dict) and isinstance(v.get("noise"), int | float)
                and math.isfinite(v["noise"]) and v["noise"] >= 0
                and isinstance(v.get("pairs"), int) and v["pairs"] >= 2]
        if not arms:
            continue
        squares += sum(n * n * k for n, k in arms)
        pairs += sum(k for _, k in arms)
        ids.append(info.id)
        if len(ids) == POOL_EXPERIMENTS:
            break
    if pairs < MIN_NOISE_PAIRS:
        return None
    return Noise(math.sqrt(squares / pairs), tuple(ids), pairs)


def node_noise(infos: Iterable[ExperimentInfo]) -> Noise:
    """:func:`measured_noise`, else the default."""
    return measured_noise(infos) or Noise(stats.DEFAULT_PAIR_NOISE)


def budget_pairs(steps: int, block_steps: int, arms: int) -> int:
    """Pairs each challenger gets with the baseline in an interleaved budget: one per round
    of ``arms`` blocks."""
    return steps // max(1, block_steps * arms)


def auto_band(noise: Noise, pairs: int) -> tuple[float, dict[str, Any]]:
    """The band for an experiment of ``pairs`` pairs, and the record of how it was chosen
    (stored with the experiment: ``rule`` is what the pages show)."""
    band = stats.reachable_band(noise.value, pairs)
    if band is None:  # under 2 pairs there is no interval: any band is out of reach
        band = stats.DEFAULT_EQUIVALENCE
        rule = f"auto: {pairs} pairs give no interval, no band is reachable; the default kept"
    else:
        rule = f"auto: the band an A/A reaches in {pairs} pairs at {noise.describe()}"
    return band, {"auto": True, "band": band, "noise": noise.value,
                  "noise_experiments": list(noise.experiments), "noise_pairs": noise.pairs,
                  "pairs": pairs, "rule": rule}


def resolve(spec: ExperimentSpec, infos: Iterable[ExperimentInfo]
            ) -> tuple[ExperimentSpec, dict[str, Any] | None]:
    """``spec`` with its band set, and the record of how the node chose it (None: the user
    gave one). A forked experiment's pairs are trials, a handful, whose noise the node does
    not measure per block: it keeps ``stats.DEFAULT_EQUIVALENCE``, and says so."""
    if spec.equivalence is not None:
        return spec, None
    if spec.mode != "interleaved":
        band = stats.DEFAULT_EQUIVALENCE
        record = {"auto": True, "band": band, "rule": (
            "auto: the default; a forked experiment's pairs are its few trials, and the node "
            "measures noise per interleaved block")}
        return replace(spec, equivalence=band), record
    band, record = auto_band(node_noise(infos),
                             budget_pairs(spec.steps, spec.block_steps, len(spec.arms)))
    return replace(spec, equivalence=band), record


def band_label(equivalence: float | None, rule: str | None) -> str:
    """``±6% (auto: the band an A/A reaches in 24 pairs at ...)``: an experiment's band as
    the pages and the CLI show it (``ExperimentInfo.equivalence`` and ``equivalence_rule``)."""
    if equivalence is None:
        return "\u2013"
    return f"\u00b1{round(equivalence * 100, 1):g}% ({rule or 'set by the submission'})"
