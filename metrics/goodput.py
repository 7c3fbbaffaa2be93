"""Goodput and badput of a run: the one definition of where its wall time went.

Google's ML Goodput splits a job's time into productive training and "badput" buckets; Meta's
ETTR (effective training time ratio) asks how much of the wall time survived failures. Both
need what only the worker knows (a checkpoint save looks like training from outside) and what
only the daemon knows (when it launched the job, when the job ended). The worker keeps a
ledger of its seconds (``trainer/ledger.py``) and sends a snapshot with every step report and
its finished event; :class:`GoodputFold` folds a run's lead-rank snapshots, attempt by attempt
(a torchrun restart starts new processes: a new ``started``), with the daemon's launch and end.

The partition, exact by construction (productive + every badput = wall):

- ``startup``: launch to each attempt's first step (the launcher, the interpreter, the model's
  build, the link probe), less a resume's restore;
- ``restart``: from a failed attempt's last report to its successor's process start (the
  failed attempt's unreported last steps, the failure's detection and the relaunch);
- ``checkpoint_restore``, ``checkpoint_save``, ``evaluation``, ``data_wait``: the workers'
  spans;
- ``numerics_skip``: steps whose update was dropped (an fp16 overflow, numerics' skip_step,
  the step a rollback undoes);
- ``profiling``: writing the traces of a profile asked for on demand (the traced steps train,
  and count as training);
- ``progress_lost``: training time of steps redone after a restart or a rollback, from the
  checkpoint the job went back to (interpolated between step reports);
- ``shutdown``: the last report to the end (process exit, torchrun's teardown);
- ``productive``: the rest of the workers' training time.

ETTR counts, as Meta's does, what failures and restarts cost: (wall - startup - restart -
checkpoint_restore - progress_lost - shutdown) / wall; checkpoint saves, evaluation, data wait
and skipped steps are part of a run that did not fail.

Counters must not go down, but time trained since the last checkpoint may still be lost, so
what is exported as goodput is the *committed* productive time: that of steps a checkpoint
holds (all of it once the run ends).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from traind.contracts.events import Event, LifecycleEvent, NumericsEvent, StepEvent

BADPUT = ("startup", "restart", "data_wait", "checkpoint_save", "checkpoint_restore",
          "evaluation", "progress_lost", "numerics_skip", "profiling", "shutdown")
# the worker ledger's kinds (trainer/ledger.py) and the badput each is
FROM_LEDGER = {"setup": "startup", "restore": "checkpoint_restore",
               "checkpoint": "checkpoint_save", "eval": "evaluation",
               "numerics": "numerics_skip", "data": "data_wait",
               "profile": "profiling"}
# what ETTR takes off the wall time: the cost of starting and of failing
ETTR_LOSS = ("startup", "restart", "checkpoint_restore", "progress_lost", "shutdown")


@dataclass(frozen=True, slots=True)
class Goodput:
    """A run's time, in seconds; ``committed``: productive time a checkpoint holds."""

    wall: float
    productive: float
    committed: float
    badput: dict[str, float]
    attempts: int

    @property
    def ratio(self) -> float:
        """Goodput: productive / wall (0 before any time has passed)."""
        return self.productive / self.wall if self.wall > 0 else 0.0

    @property
    def ettr(self) -> float:
        """Effective training time ratio (see the module's doc)."""
        if self.wall <= 0:
            return 0.0
        return max(0.0, self.wall - sum(self.badput[k] for k in ETTR_LOSS)) / self.wall

    def as_dict(self) -> dict[str, Any]:
        """What is stored with the run and served to the pages."""
        return {"wall": self.wall, "productive": self.productive, "committed": self.committed,
                "badput": dict(self.badput), "attempts": self.attempts,
                "ratio": self.ratio, "ettr": self.ettr}


@dataclass(slots=True)
class _Attempt:
    begin: float  # unix: the launch, or the previous attempt's last report
    started: float  # unix: its processes' start
    last: dict[str, float]  # its newest ledger snapshot


@dataclass(slots=True)
class GoodputFold:
    """A run's lead-rank events folded into :class:`Goodput` (``launched``: unix time the
    daemon launched the job)."""

    launched: float
    attempts: list[_Attempt] = field(default_factory=list)
    # (step, training seconds so far, all attempts) at each report on the current line of
    # progress: a rewind to a step drops the points past it
    steps: list[int] = field(default_factory=list)
    trained: list[float] = field(default_factory=list)
    lost: float = 0.0
    committed: float = 0.0
    finished_at: float | None = None  # the finished event's snapshot time

    def observe(self, event: Event) -> bool:
        """Fold one lead-rank event; whether the figures changed."""
        if isinstance(event, StepEvent) and event.clock:
            self._snapshot(event.step, event.clock)
            return True
        if isinstance(event, LifecycleEvent):
            if event.phase == "finished" and isinstance(event.detail.get("clock"), dict):
                self._snapshot(event.step, event.detail["clock"])
                self.finished_at = float(event.detail["clock"]["time"])
                return True
            if event.phase == "started":  # a (re)start goes on from its checkpoint's step
                changed = self._rewind(event.step)
                if not self.steps:  # the first line of progress begins here
                    self._point(event.step, self._train())
                return changed
            if event.phase == "checkpoint":
                return self._commit(event.step)
        if isinstance(event, NumericsEvent) and event.action == "rollback" \
                and event.resume_step >= 0:
            return self._rewind(event.resume_step)
        return False

    def _train(self) -> float:
        return sum(a.last.get("train", 0.0) for a in self.attempts)

    def _snapshot(self, step: int, clock: dict[str, float]) -> None:
        started = float(clock["started"])
        if not self.attempts or abs(started - self.attempts[-1].started) > 1e-6:
            begin = self.attempts[-1].last["time"] if self.attempts else self.launched
            self.attempts.append(_Attempt(begin=begin, started=started, last=dict(clock)))
        else:
            self.attempts[-1].last = dict(clock)
        self._point(step, self._train())

    def _point(self, step: int, trained: float) -> None:
        i = bisect.bisect_right(self.steps, step)
        del self.steps[i:], self.trained[i:]  # a point at an earlier step: a rewind we missed
        self.steps.append(step)
        self.trained.append(trained)

    def _trained_at(self, step: int) -> float:
        """Training seconds (on the current line) when ``step`` was reached, interpolated
        between the reports around it; before the first report, that report's figure."""
        i = bisect.bisect_left(self.steps, step)
        if i < len(self.steps) and self.steps[i] == step:
            return self.trained[i]
        if i == 0:
            return self.trained[0] if self.trained else 0.0
        if i == len(self.steps):
            return self.trained[-1]
        s0, s1, t0, t1 = self.steps[i - 1], self.steps[i], self.trained[i - 1], self.trained[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)

    def _rewind(self, step: int) -> bool:
        """Training goes back to ``step``: the time spent past it is lost."""
        if not self.steps or self.steps[-1] <= step:
            return False
        now = self.trained[-1]
        self.lost += max(0.0, now - self._trained_at(step))
        i = bisect.bisect_right(self.steps, step)
        del self.steps[i:], self.trained[i:]
        self.steps.append(step)
        self.trained.append(now)  # the line goes on from here, the lost time behind it
        return True

    def _commit(self, step: int) -> bool:
        if not self.steps:
            return False
        committed = max(self.committed, self._trained_at(step) - self.lost)
        changed, self.committed = committed != self.committed, committed
        return changed

    def account(self, end: float | None = None) -> Goodput:
        """The run's figures at ``end`` (unix; the run's end), else up to its newest report.
        Every second from the launch to then is in one bucket."""
        ended = end is not None
        badput = dict.fromkeys(BADPUT, 0.0)
        for i, a in enumerate(self.attempts):
            badput["startup" if i == 0 else "restart"] += max(0.0, a.started - a.begin)
            for kind, bucket in FROM_LEDGER.items():
                badput[bucket] += a.last.get(kind, 0.0)
        last = self.attempts[-1].last["time"] if self.attempts else self.launched
        if end is None:
            end = last
        elif not self.attempts:  # nothing reported: all of it was start-up
            badput["startup"] = max(0.0, end - self.launched)
        else:
            badput["shutdown"] = max(0.0, end - last)
        productive = max(0.0, self._train() - self.lost)
        badput["progress_lost"] = self.lost
        done = ended and self.finished_at is not None  # every step it trained is kept
        return Goodput(wall=max(0.0, end - self.launched), productive=productive,
                       committed=productive if done else min(self.committed, productive),
                       badput=badput, attempts=len(self.attempts))


@dataclass(slots=True)
class NodeGoodput:
    """The node's goodput since the daemon started (``started``, unix): its runs' productive
    time over its wall time, and its idle time (no run's workers alive). Several runs at once
    can make the ratio exceed 1: each run's productive time counts. It holds the running runs
    only; an ended run's figure is added to a sum."""

    started: float
    _ended: float = 0.0  # productive seconds of the runs that ended
    _running: dict[int, float] = field(default_factory=dict)  # run -> productive so far
    _idle: float = 0.0  # closed idle intervals
    _idle_since: float | None = None  # open idle interval (None while a run is alive)

    def __post_init__(self) -> None:
        self._idle_since = self.started

    def run_started(self, run: int, at: float) -> None:
        if not self._running and self._idle_since is not None:
            self._idle += max(0.0, at - self._idle_since)
            self._idle_since = None
        self._running.setdefault(run, 0.0)

    def run_progress(self, run: int, figures: Goodput) -> None:
        if run in self._running:
            self._running[run] = figures.productive

    def run_ended(self, run: int, at: float) -> None:
        if run not in self._running:
            return
        self._ended += self._running.pop(run)
        if not self._running:
            self._idle_since = at

    def productive(self) -> float:
        return self._ended + sum(self._running.values())

    def idle(self, now: float) -> float:
        open_ = max(0.0, now - self._idle_since) if self._idle_since is not None else 0.0
        return self._idle + open_

    def ratio(self, now: float) -> float:
        wall = now - self.started
        return self.productive() / wall if wall > 0 else 0.0
