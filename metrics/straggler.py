"""Which rank is slow: arrival skew at the gradient collectives, and the rank to blame.

Under DDP the all-reduce equalises every rank's step time, so a slow rank hides in per-rank
step or backward times: the others' backward waits for it. It shows in *arrival*: every rank
stamps when its first gradient bucket of a step reaches the collectives, on a clock the ranks
share (``trainer/clocksync.py``: offsets estimated at start, with an error bound), and sends it
with its step report (``StepEvent.arrival``). Per step, once every rank's stamp is in:

- the skew: last arrival minus first;
- the last rank, and its lag: its arrival minus the median of the others'.

Over the newest ``WINDOW`` complete steps the rank that came last most often is named the
straggler when chance cannot explain it: it was last in ``k`` of ``n`` steps, and
``P(X >= k)`` for ``X ~ Binomial(n, 1/ranks)`` (every rank equally likely last) is below
``ALPHA``; and its median lag exceeds the clocks' error bound (``MIN_LAG`` at least), so the
clocks' disagreement cannot be what made it last. ``confidence`` is ``1 - P``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

WINDOW = 200  # complete steps judged
MIN_STEPS = 10  # below this, nobody is named
ALPHA = 1e-3
MIN_LAG = 1e-3  # seconds: a lag this small is noise even with perfect clocks
PENDING = 64  # steps waiting for their last rank's stamp, at most (older ones are dropped)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed exactly (n is at most WINDOW; scipy.stats is
    kept out of the daemon's start-up, tests/daemon/test_startup.py)."""
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


@dataclass(frozen=True, slots=True)
class StepSkew:
    step: int
    skew: float  # last arrival - first, seconds
    last: int  # the rank that arrived last
    lag: float  # its arrival - the median of the other ranks'


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int | None  # None: nobody is slow beyond chance
    confidence: float  # 1 - P(the most-often-last rank is last this often by chance)
    share: float  # of the judged steps, those the most-often-last rank was last in
    lag: float  # its median lag over those steps, seconds
    steps: int  # complete steps judged
    candidate: int | None  # the most-often-last rank, named or not


@dataclass(slots=True)
class StragglerFold:
    """Every rank's arrivals of one run (``ranks``: its world size)."""

    ranks: int
    error: float = 0.0  # the clocks' error bound (the started events'), seconds
    _pending: dict[int, dict[int, float]] = field(default_factory=dict)
    _judged: deque[StepSkew] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, rank: int, step: int, arrival: float) -> StepSkew | None:
        """One rank's arrival at ``step``; the step's skew once every rank's is in."""
        if self.ranks < 2 or arrival <= 0:
            return None
        stamps = self._pending.setdefault(step, {})
        stamps[rank] = arrival
        if len(stamps) < self.ranks:
            while len(self._pending) > PENDING:  # a rank's report lost: let its step go
                del self._pending[min(self._pending)]
            return None
        del self._pending[step]
        last = max(stamps, key=stamps.__getitem__)
        others = [t for r, t in stamps.items() if r != last]
        skew = StepSkew(step=step, skew=stamps[last] - min(stamps.values()), last=last,
                        lag=stamps[last] - statistics.median(others))
        self._judged.append(skew)
        return skew

    def verdict(self) -> Straggler:
        n = len(self._judged)
        if n == 0 or self.ranks < 2:
            return Straggler(None, 0.0, 0.0, 0.0, n, None)
        counts = Counter(s.last for s in self._judged)
        candidate, k = counts.most_common(1)[0]
        p = binomial_tail(k, n, 1 / self.ranks)
        lag = statistics.median(s.lag for s in self._judged if s.last == candidate)
        named = n >= MIN_STEPS and p < ALPHA and lag > max(self.error, MIN_LAG)
        return Straggler(candidate if named else None, 1 - p, k / n, lag, n, candidate)
