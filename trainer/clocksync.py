"""A clock the ranks share: each rank's offset from rank 0's wall clock, estimated at start.

Straggler attribution (issue 17) compares the moments ranks arrive at a collective, so their
clocks must agree to better than the skew being looked for. Ranks on one node share a clock;
ranks on other nodes may be off by milliseconds (NTP) or more. At start every rank leaves a
barrier and reads its clock, ``ROUNDS`` times; rank r's offset is the median of its reading
minus rank 0's, and the error bound is half the spread of those differences plus the barrier's
own exit skew, which it contains (ranks leave a barrier within that spread of each other).
An arrival stamped ``t`` on rank r is ``t - offset`` on the shared clock, give or take the
bound, which the started event reports with the offset.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from traind.trainer import distributed

if TYPE_CHECKING:
    from traind.trainer.distributed import DistInfo

ROUNDS = 7


@dataclass(frozen=True, slots=True)
class ClockSync:
    offset: float  # seconds this rank's wall clock is ahead of rank 0's
    error: float  # bound on |offset error|, seconds (0 for one rank)

    def shared(self, t: float) -> float:
        """This rank's wall-clock time ``t`` on rank 0's clock."""
        return t - self.offset


def synchronize(info: DistInfo, rounds: int = ROUNDS) -> ClockSync:
    """Every rank's offset from rank 0 (a collective: every rank calls it)."""
    if info.world_size == 1:
        return ClockSync(0.0, 0.0)
    diffs = []
    for _ in range(rounds):
        distributed.barrier(info)
        stamps = distributed.all_gather(time.time(), info)
        diffs.append(stamps[info.rank] - stamps[0])
    # every rank's bound: the largest spread any rank saw (one figure for the job)
    spread = (max(diffs) - min(diffs)) / 2
    error = max(distributed.all_gather(spread, info))
    return ClockSync(statistics.median(diffs), error)
