"""A run's summary, folded from its events: what the runs page and the database show."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from traind.contracts.events import DataEvent, EvalEvent, Event, LifecycleEvent, StepEvent
from traind.metrics.goodput import Goodput, GoodputFold
from traind.metrics.straggler import StepSkew, Straggler, StragglerFold
from traind.metrics.throughput import Throughput, mfu


@dataclass(slots=True)
class Changes:
    """What one event changed of a run's folded figures (None: nothing)."""

    goodput: Goodput | None = None
    skew: StepSkew | None = None  # a step whose every rank's arrival is now in
    straggler: Straggler | None = None  # the verdict after that step


@dataclass
class RunSummary:
    total_steps: int = 0
    step: int = 0
    loss: float | None = None
    first_loss: float | None = None
    val_loss: float | None = None
    tokens: int = 0
    tokens_per_second: float = 0.0  # the job's, smoothed: metrics/throughput.py
    world_size: int = 1
    params: int | None = None
    flops_per_token: float | None = None
    device: str | None = None
    # Each rank's device peak FLOP/s on this node (the started events; None: unknown, as on
    # the CPU), and the MFU they give (metrics/throughput.mfu): the job's model FLOP/s over
    # the sum of its devices' peaks. None where there is no figure.
    peak_flops: dict[str, float | None] = field(default_factory=dict)
    mfu: float | None = None
    checkpoints: int = 0
    last_checkpoint: str | None = None
    ab: dict[str, Any] = field(default_factory=dict)  # arm -> verdict so far (experiments/ab.py)
    # This node's first rank speaks for the job (0 on one node; on the others of a
    # multi-node job, their first: ranks are numbered node by node, nproc_per_node each).
    ranks_per_node: int = 1
    finished_step: int | None = None  # the step the workers ended at (their last event)
    # CPUs and threads (the started event, trainer/threads.py): ranks_per_node x threads
    # above usable_cpus oversubscribes the node by the job's own doing.
    threads: int | None = None  # intra-op threads per rank
    usable_cpus: int | None = None
    # The host while the run trained, checked once a flush (every second): how many checks
    # found more runnable threads than usable CPUs (metrics/host.py's oversubscribed).
    host_checks: int = 0
    host_oversubscribed: int = 0
    # Where the run's wall time went (metrics/goodput.Goodput.as_dict), up to its newest
    # report while it trains, to its end after; folded from the lead rank's ledger once the
    # supervisor says when it launched the job (:meth:`launched`).
    goodput: dict[str, Any] | None = None
    # Which rank the others wait for (metrics/straggler.Straggler, with the clocks' error and
    # the last judged step's skew): every rank's arrivals at the gradient collectives.
    straggler: dict[str, Any] | None = None
    # What the lead rank trains on and what its data cache did (:func:`data_summary`).
    data: dict[str, Any] | None = None
    dirty: bool = False
    _throughput: Throughput = field(default_factory=Throughput, repr=False)
    _goodput: GoodputFold | None = field(default=None, repr=False)
    _straggler: StragglerFold | None = field(default=None, repr=False)
    _peak_ranks: int = field(default=0, repr=False)  # the world size peak_flops is of

    def lead(self, rank: int) -> bool:
        return rank % self.ranks_per_node == 0

    def launched(self, at: float) -> None:
        """The job was launched at ``at`` (unix): goodput counts from here."""
        self._goodput = GoodputFold(launched=at)

    def ended(self, at: float) -> Goodput | None:
        """The job ended at ``at`` (unix): the run's final goodput (None if never launched)."""
        if self._goodput is None:
            return None
        figures = self._goodput.account(end=at)
        self.goodput, self.dirty = figures.as_dict(), True
        return figures

    def observe(self, event: Event) -> Changes:
        """Fold one event; the figures it changed (the supervisor's listeners get them)."""
        self.dirty = True
        lead = self.lead(event.rank)
        changes = Changes()
        if lead and self._goodput is not None and self._goodput.observe(event):
            changes.goodput = self._goodput.account()
            self.goodput = changes.goodput.as_dict()
        if isinstance(event, StepEvent) and event.arrival > 0 and self._straggler is not None:
            changes.skew = self._straggler.observe(event.rank, event.step, event.arrival)
            if changes.skew is not None:
                changes.straggler = self._straggler.verdict()
                self.straggler = {**dataclasses.asdict(changes.straggler),
                                  "error": self._straggler.error,
                                  "skew": changes.skew.skew, "at_step": changes.skew.step}
        elif isinstance(event, LifecycleEvent) and event.phase == "started":  # every rank's
            ranks = int(event.detail.get("world_size", 1))
            fold = self._straggler
            if fold is None or fold.ranks != ranks:  # a new job's ranks
                fold = self._straggler = StragglerFold(ranks)
            fold.error = max(fold.error, float(event.detail.get("clock_error", 0.0)))
            if ranks != self._peak_ranks:  # a new job's ranks: the old ones' devices go
                self.peak_flops, self._peak_ranks = {}, ranks
            self.peak_flops[str(event.rank)] = event.detail.get("peak_flops")
        self._observe(event, lead)
        return changes

    def _observe(self, event: Event, lead: bool) -> None:
        if isinstance(event, StepEvent):
            self.tokens += event.tokens * event.steps
            if not lead:
                return
            self.step, self.loss = event.step, event.loss
            if self.first_loss is None:
                self.first_loss = event.loss
            self._throughput.observe(event, self.world_size)
            self.tokens_per_second = self._throughput.smoothed
            self.mfu = mfu(self.tokens_per_second, self.flops_per_token, self.job_peaks())
        elif isinstance(event, EvalEvent) and lead:
            self.val_loss = event.val_loss
        elif isinstance(event, DataEvent) and lead:
            self.data = data_summary(event)
        elif isinstance(event, LifecycleEvent) and lead:
            d = event.detail
            if event.phase in ("started", "resumed"):
                self.world_size = int(d.get("world_size", self.world_size))
                self.params = d.get("params", self.params)
                self.flops_per_token = d.get("flops_per_token", self.flops_per_token)
                self.device = d.get("device", self.device)
                self.total_steps = int(d.get("total_steps", self.total_steps))
                self.threads = d.get("threads", self.threads)
                self.usable_cpus = d.get("usable_cpus", self.usable_cpus)
                if event.phase == "resumed" and d.get("path"):  # the one it trains on from
                    self.last_checkpoint = d["path"]
            elif event.phase == "checkpoint":
                self.checkpoints += 1
                self.last_checkpoint = d.get("path")
            elif event.phase == "finished":
                self.finished_step = event.step

    def job_peaks(self) -> list[float | None]:
        """Every device's peak of the job, one per rank. A node sees only its own ranks'
        started events; a multi-node job's other nodes run as many ranks on the same parts
        (the launcher gives each node ``nproc_per_node``), so its peaks repeat this node's.
        A missing device (a rank not started yet) is an unknown peak: no figure until all
        of this node's are in."""
        mine = list(self.peak_flops.values())
        if len(mine) < min(self.world_size, self.ranks_per_node):
            return [*mine, None]
        if self.world_size <= len(mine):
            return mine
        return mine * (self.world_size // len(mine))

    @property
    def training(self) -> bool:
        """Between the first step and the end: what the host checks count."""
        return self.step > 0 and self.finished_step is None

    def note_host(self, oversubscribed: bool) -> None:
        """One host check while the run trains. Not marked dirty: a training run's steps
        write the summary every second anyway, and the counts ride along."""
        self.host_checks += 1
        self.host_oversubscribed += int(oversubscribed)

    def as_dict(self) -> dict[str, Any]:
        # Not asdict: that would also copy the throughput's fold, which is no part of the row.
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
                if not f.name.startswith("_") and f.name != "dirty"}


def data_summary(e: DataEvent) -> dict[str, Any]:
    """A DataEvent as the run's row keeps it: the data kept, what each filter removed, and
    each cache tier's hits, misses and wait (cumulative, as the event)."""
    return {
        "tokens": e.tokens_kept, "documents": e.documents_kept,
        "filtered": {r: {"documents": n, "bytes": e.filtered_bytes.get(r),
                         "tokens": e.filtered_tokens.get(r)} for r, n in e.filtered.items()},
        "tiers": {t: {"hits": e.tier_hits.get(t, 0), "misses": e.tier_misses.get(t, 0),
                      "wait_seconds": e.tier_wait_seconds.get(t, 0.0)} for t in e.tier_hits},
        "wait_seconds": e.prefetch_wait_seconds, "batches": e.batches_served,
    }
