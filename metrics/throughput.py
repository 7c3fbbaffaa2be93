"""Throughput: the one definition of a job's tokens per second, and of its MFU (:func:`mfu`).

Every tokens/s traind shows comes from here: the Prometheus gauge
(``traind_train_tokens_per_second``), the live page and the runs page (``RunSummary``, also
what the database stores), the promotions' guard, forked trials and A/B blocks.

**The figure is the whole job's tokens per second of wall time.** Between two step reports
of one rank (``contracts/events.py`` StepEvent)::

    tokens/s = tokens x steps x world_size / (time - the previous report's time)

``tokens`` is the rank's tokens of one step, ``steps`` the steps since its previous report
(``telemetry.every``) and ``time`` the wall clock at the end of the reported step. Why:

- The job's, not a rank's: under data parallelism the ranks run in lock step, so one rank's
  reports times ``world_size`` is the job's figure, on any rank. It is the number Grafana's
  ``sum by (run) (traind:train_tokens:rate1m)`` shows (the tokens counter of every rank over
  wall time), so the browser and Grafana tell one number.
- Wall time, not ``step_seconds``: the step timer leaves out what the job also spends its
  time on (evaluations, checkpoints, telemetry, probes); a user waits for all of it.
- Every step counts, also those between reports (``steps``).

A report with no interval to measure (a run's first, the first after a restart or rollback,
or a clock that did not advance) stands for its own step: ``tokens x world_size /
step_seconds``.

The **shown** figure (gauge, live page, runs page) is smoothed: an exponentially decaying
sum of tokens over an exponentially decaying sum of seconds, with a time constant of
``SMOOTHING_SECONDS`` of wall time. A ratio of sums weights each interval by its duration (a
long checkpoint counts for its whole length, not as one report among hundreds) and does not
depend on how often a run reports; a steady job shows exactly its rate. Decisions read their
own windows of the same definition: the guard the median of per-interval figures (a median,
so one checkpoint is not a verdict), a forked trial the ratio of its totals after warm-up
(:class:`Window`), an A/B block (``daemon/ab.py``) :func:`rate` over its measured steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from traind.contracts.events import StepEvent

# Memory of the shown figure: the mean age of what it averages, as Grafana's 1-minute rate
# (a uniform 60 s window's mean age is 30 s), so both settle on one number alike.
SMOOTHING_SECONDS = 30.0


def rate(tokens: float, seconds: float) -> float:
    """Tokens per second over a window; NaN when the window has no time (no figure)."""
    return tokens / seconds if seconds > 0 else math.nan


def mfu(tokens_per_second: float, flops_per_token: float | None,
        peaks: Sequence[float | None]) -> float | None:
    """Model FLOPs utilisation, the one definition (the Prometheus rule
    ``traind:mfu:ratio_rate1m`` in metrics/grafana.py, the run page, the database's run
    summary and bench/gpu_check.py all compute this): the job's model FLOPs per second
    (its tokens/s above x the model's training FLOPs per token) over the **sum** of its
    devices' datasheet peaks, one per rank (trainer/device.py's, for the math the run's
    matmuls use). Eight ranks at one device's worth of FLOP/s each are 8 devices' peaks,
    not one: dividing by a single device's peak overstates MFU by the number of ranks.

    None, not a made-up figure, when there is nothing to divide: no FLOPs per token, no
    device, or any device whose peak is unknown (the CPU, a GPU not in the table)."""
    if not flops_per_token or not peaks or any(not p for p in peaks):
        return None
    if not math.isfinite(tokens_per_second) or tokens_per_second < 0:
        return None
    return tokens_per_second * flops_per_token / sum(p for p in peaks if p)


def rank_tokens_per_second(event: StepEvent) -> float:
    """One rank's own speed, for telling ranks apart (the run page's per-rank lines): its
    tokens of the reported step over that step's time. Not the job's figure above, and no
    sum of them is: ranks in lock step wait for each other inside a step (the others'
    backward waits on a straggler's all-reduce), so they differ where ranks run unevenly
    and a straggler shows clearest in its own phases."""
    return rate(event.tokens, event.step_seconds)


def interval(event: StepEvent, previous: StepEvent | None,
             world_size: int) -> tuple[float, float]:
    """The job's tokens and the wall seconds of the interval ``event`` reports (see the
    module's docstring): since ``previous`` (the same rank's last report) when the two are
    contiguous, else ``event``'s own step. Seconds are 0 when there is nothing to time."""
    contiguous = (previous is not None and event.step - previous.step == event.steps
                  and event.time > previous.time)
    if contiguous:
        assert previous is not None
        return float(event.tokens * event.steps * world_size), event.time - previous.time
    return float(event.tokens * world_size), max(0.0, event.step_seconds)


@dataclass(slots=True)
class Throughput:
    """One rank's step reports of a job, folded: :attr:`last` is the figure of the latest
    interval, :attr:`smoothed` the shown one (0.0 until a report could be timed)."""

    previous: StepEvent | None = None
    last: float = 0.0
    tokens: float = 0.0  # decayed sums (see the module's docstring)
    seconds: float = 0.0

    def observe(self, event: StepEvent, world_size: int) -> tuple[float, float]:
        """Fold one report in; returns its interval's ``(tokens, seconds)``."""
        tokens, seconds = interval(event, self.previous, world_size)
        self.previous = event
        if seconds > 0:
            self.last = tokens / seconds
            keep = math.exp(-seconds / SMOOTHING_SECONDS)
            self.tokens = self.tokens * keep + tokens
            self.seconds = self.seconds * keep + seconds
        return tokens, seconds

    @property
    def smoothed(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Window:
    """A ratio of totals over the reports after the first ``skip`` (warm-up), or over all of
    them while there are no more: what a whole stretch of training achieved.
    :attr:`tokens_per_second` is None before any report could be timed."""

    skip: int = 0
    seen: int = 0
    tokens: float = 0.0  # after the warm-up
    seconds: float = 0.0
    warmup_tokens: float = 0.0
    warmup_seconds: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        if seconds <= 0:
            return  # an untimed report says nothing about speed
        self.seen += 1
        if self.seen > self.skip:
            self.tokens += tokens
            self.seconds += seconds
        else:
            self.warmup_tokens += tokens
            self.warmup_seconds += seconds

    @property
    def tokens_per_second(self) -> float | None:
        if self.seconds > 0:
            return self.tokens / self.seconds
        if self.warmup_seconds > 0:
            return self.warmup_tokens / self.warmup_seconds
        return None
