"""What the web layer may ask of the daemon: a protocol and the frozen views it returns.

The web package depends on this module only, never on the job runner, the database models or
trainer internals. The daemon's ``Node`` implements it; web tests may build a small fake.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from traind.daemon.config import MetricsConfig
from traind.errors import FieldErrors
from traind.trainer.config import COMPRESSION_METHODS as COMPRESSION_METHODS  # for web forms
from traind.trainer.config import TelemetryConfig

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable
    from contextlib import AbstractAsyncContextManager
    from datetime import datetime
    from pathlib import Path

    from pydantic import BaseModel

    from traind.errors import FieldError

# A page of a list (runs, experiments, searches, promotions, the queue): what a page renders
# and an API call returns unless it asks for another page (limit/offset, at most MAX_PAGE).
PAGE = 50
MAX_PAGE = 500
MAX_RANKS = 1024  # ranks one profile may name



@dataclass(frozen=True, slots=True)
class Setting:
    """A config field a page needs and that is off by default: the page names it, says what
    it does and how to turn it on (read from the field's declaration, its one home)."""

    path: str  # dotted, as in a TOML table or --set
    default: Any
    description: str
    example: Any  # a value that turns it on

    @property
    def env(self) -> str:
        """The environment variable that sets it (daemon/config.py's TRAIND_A__B form)."""
        return "TRAIND_" + self.path.upper().replace(".", "__")


def _setting(model: type[BaseModel], path: str, example: Any) -> Setting:
    f = model.model_fields[path.rpartition(".")[2]]
    return Setting(path, f.default, f.description or "", example)


# The Communication page's bus-bandwidth chart needs the all-reduce probe, off by default.
PROBE_SETTING = _setting(TelemetryConfig, "telemetry.probe_every", 100)
# The Hardware page's GPU charts need the NVML collector (on by default; a node may turn it off).
GPU_SETTING = _setting(MetricsConfig, "metrics.gpu", True)


class ShuttingDown(RuntimeError):
    """The daemon is stopping: it starts nothing new (the API says 503; the work stays
    queued for the next start)."""


@dataclass(frozen=True, slots=True)
class RunView:
    id: int
    name: str
    state: str  # one of contracts.states.RUN_STATES
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None  # for failed runs: the exit code's meaning and the last log lines
    summary: dict[str, Any] = field(default_factory=dict)  # step, loss, val_loss, tokens/s, ...


# What the runs table sorts by: the run's own columns, and the figures of its summary.
RUN_SORT_KEYS = ("id", "name", "state", "created_at", "started_at", "finished_at", "step",
                 "loss", "val_loss", "tokens_per_second")


# A config filter as a person types it, ``precision.mode=bf16``: a dotted key of identifiers
# (the config tree's own names), ``=``, a value. The key becomes a JSON path bound as a
# parameter, never SQL text or a file path; the runs page's input checks the same pattern.
CONFIG_KEY_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
CONFIG_FILTER_MAX = 200  # characters of key=value
_CONFIG_KEY = re.compile(CONFIG_KEY_PATTERN)
_CONFIG_DEPTH = 8  # the config tree is 2-3 deep; a longer key is a mistake


@dataclass(frozen=True, slots=True)
class ConfigMatch:
    """Runs whose stored config holds ``value`` at ``key`` (a path of names). The value
    matches a string equal to it, and where it reads as a JSON number, ``true``, ``false``
    or ``null``, that number (``2`` finds 2 and 2.0), boolean or null as well."""

    key: tuple[str, ...]
    value: str

    def __str__(self) -> str:  # as typed, for the page's input and links
        return f"{'.'.join(self.key)}={self.value}"


def config_match(text: str) -> ConfigMatch:
    """``key=value`` parsed; ``ValueError`` says what is wrong with it (the caller names
    the field)."""
    if len(text) > CONFIG_FILTER_MAX:
        raise ValueError(f"at most {CONFIG_FILTER_MAX} characters")
    key, eq, value = text.strip().partition("=")
    key = key.strip()
    if not eq:
        raise ValueError("give key=value, such as precision.mode=bf16")
    if not _CONFIG_KEY.fullmatch(key):
        raise ValueError(f"the key must be dotted names (letters, digits, _), such as "
                         f"precision.mode, not {key[:40]!r}")
    parts = tuple(key.split("."))
    if len(parts) > _CONFIG_DEPTH:
        raise ValueError(f"the key has at most {_CONFIG_DEPTH} parts")
    return ConfigMatch(key=parts, value=value.strip())


@dataclass(frozen=True, slots=True)
class RunQuery:
    """Which runs a page of the table shows, and in which order."""

    state: str | None = None  # one of contracts.states.RUN_STATES
    name: str | None = None  # a part of the name, any case
    sort: str = "id"  # one of RUN_SORT_KEYS
    descending: bool = True  # newest (largest) first; runs without the figure come last
    # The experiment's runs: its interleaved job, or the runs of its forked trials.
    experiment: int | None = None
    config: ConfigMatch | None = None

    @property
    def filtered(self) -> bool:
        return bool(self.state or self.name or self.experiment is not None or self.config)


@dataclass(frozen=True, slots=True)
class RunDetail:
    """What a run's page shows beside its series: the config it was recorded with, what
    happened to it (lifecycle and numerics events, oldest first), the experiments it belongs
    to, and the tail of its workers' log."""

    run: RunView
    kind: str  # job | experiment | trial
    node: str
    config: dict[str, Any]
    events: list[dict[str, Any]]  # {"kind", "step", "time", "data"}
    experiments: list[dict[str, Any]]  # {"id", "name", "state", "role"}: interleaved | trial
    log_tail: str
    running_here: bool  # stoppable from this node


@dataclass(frozen=True, slots=True)
class MetricSample:
    name: str  # as exposed (counters with _total)
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class ExperimentSpec:
    """An A/B experiment as a user submits it. ``overrides``: base-config fields by dotted
    path ({"model.n_layers": 2}); arms: {"name", "compression": {...}, "precision":
    "fp32"|"bf16"|None} ("fp16" too in forked mode; there also "bucket_mb" and "mesh", a table
    of parallel.dp/tp/pp overrides: ``specs.MESH_ARM_FIELDS``), the first is the baseline.

    ``mode``: ``interleaved`` (arms alternate in blocks of ``block_steps`` inside one job) or
    ``forked`` (each arm runs ``steps`` steps as its own job from one starting checkpoint,
    ``repeats`` times per arm in ABBA order; ``checkpoint_run`` and ``checkpoint_step`` name
    that starting point, a checkpoint of a run of this node, or are None to make one with a
    short base job first: ids, never a path, since loading a checkpoint unpickles it).

    ``loss_margin`` is absolute, in nats of loss; ``min_effect`` (the smallest speed-up worth
    having) and ``equivalence`` (the "no difference" band) are relative: see
    ``trainer.config.InterleaveConfig``, their one description. ``equivalence`` None: the
    band the budget reaches at this node's measured noise (``daemon/experiments/bands.py``)."""

    name: str
    arms: tuple[dict[str, Any], ...]
    steps: int  # the budget, in optimizer steps
    block_steps: int = 20
    warmup_steps: int = 3
    loss_margin: float = 0.05  # nats
    min_effect: float = 0.02  # relative
    equivalence: float | None = None  # relative (0.02: +-2%); None: from the node's noise
    overrides: dict[str, Any] = field(default_factory=dict)
    mode: str = "interleaved"
    repeats: int = 2  # forked mode: trials per arm
    checkpoint_run: int | None = None  # forked mode: the run whose checkpoint starts it
    checkpoint_step: int | None = None  # ... and that checkpoint's step
    # forked mode: earlier forked experiments of this node whose starting checkpoint this one
    # starts from, taking their trials of the same arm settings (daemon/experiments/reuse.py);
    # the auto-tuner's quality rounds name the search's earlier ones. Ids, never a path.
    reuse: tuple[int, ...] = ()
    # interleaved mode: earlier interleaved experiments of this node of the same comparison
    # whose pairs each arm's verdict goes on from (daemon/experiments/reuse.py); the
    # auto-tuner's later speed rounds of a stage name the earlier ones. Ids, never a path.
    carry: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ExperimentInfo:
    id: int
    name: str
    state: str  # queued | running | done | cancelled | failed
    mode: str
    arms: tuple[str, ...]  # baseline first
    run_id: int | None  # the job that runs it (interleaved mode; None in forked mode)
    verdict: dict[str, Any] | None  # arm -> {"kind", "ratio", "low", "high", "reason", ...}
    config_hash: str
    versions: dict[str, str]
    created_at: datetime
    finished_at: datetime | None
    equivalence: float | None = None  # the "no difference" band it ran with
    equivalence_rule: str | None = None  # how the node chose it (None: the user set it)
    trial_runs: tuple[int, ...] = ()  # forked mode: each finished trial's run, in queue order
    reused_trials: int = 0  # forked mode: trials taken from earlier experiments (reuse)
    # interleaved mode: the experiments whose pairs its verdicts go on from (carry), and the
    # most pairs an arm took from them
    carried_from: tuple[int, ...] = ()
    carried_pairs: int = 0


@dataclass(frozen=True, slots=True)
class Measurement:
    """One block of an interleaved run, or one forked trial: what a verdict rests on."""

    arm: str
    index: int  # the block (interleaved, from 0 in run order) or the repeat (forked)
    step: int | None  # the block's last step; None for a trial
    tokens_per_second: float | None  # one rank's over the block; a trial's; None: unmeasured
    loss: float | None  # the block's mean training loss; a trial's final validation loss
    state: str = "done"  # a trial's (contracts.states.TRIAL_STATES)
    run_id: int | None = None  # a trial's run


@dataclass(frozen=True, slots=True)
class ArmMean:
    arm: str
    n: int  # blocks or trials with a throughput
    tokens_per_second: float | None  # geometric mean, as the verdict's ratio
    loss: float | None  # training loss (interleaved) or validation loss (forked), mean


@dataclass(frozen=True, slots=True)
class Progress:
    done: int
    of: int | None  # None: no budget recorded
    unit: str  # "pairs" | "trials"
    detail: str = ""  # "step 480 of 1,200", "1 failed"


@dataclass(frozen=True, slots=True)
class ExperimentEvidence:
    """An experiment's measurements, each arm's means and its progress
    (daemon/experiments/evidence.py)."""

    measurements: tuple[Measurement, ...]
    means: tuple[ArmMean, ...]  # in arm order, baseline first
    progress: Progress


# An experiment's budget where the form (and the CLI) offer one: 30 pairs of 2 arms in blocks
# of 20. A decided experiment stops early; this is what an A/A spends. At 400 (10 pairs) the
# band an A/A reaches here is +-19% at 8% noise per pair, a statement of little use; at 1,200
# it is +-9% (7% at the 0.061 measured quiet), and replayed on 10 real 960-step A/As every
# one reached its band (bench/ab_calibration.py --replay).
EXPERIMENT_STEPS = 1200

# A search's budgets, chosen with bench/tuner.py (the real tuner and statistics on a simulated
# space at this machine's measured noise): at 200 first-round steps and 2 quality repeats it
# found the true best in 12-22% of searches (a first round of 2-5 pairs cannot decide, and 2
# repeats give the quality test 1 degree of freedom); at 400 and 4, in 88-94%; with a round's
# budget per arm (400 per two arms) and arms measured no faster pruned, in 94-96%.
TUNE_STEPS = 400
TUNE_QUALITY_STEPS = 100
TUNE_QUALITY_REPEATS = 4


@dataclass(frozen=True, slots=True)
class AutotuneSpec:
    """An auto-tuning search as a user submits it (see daemon/autotune/search.py for the method).
    ``compressions``: tables of ``compression.*`` fields (``{"method": "powersgd",
    "powersgd_rank": 4}``; ``none`` is always included); ``bucket_mb``: DDP bucket sizes to
    try last (forked rounds); ``mesh``: search the job's other mesh shapes (dp x tp x pp of its
    world size) first (forked rounds; daemon/autotune/mesh.py); ``steps``: a stage's first
    speed round's budget per two arms (a round of k arms runs k/2 times as many, so each arm
    gets as many pairs; a forked round's per trial), doubled by each later round of a stage;
    ``quality_steps``: steps per forked trial
    of a stage's first quality round (doubled by each later one; 0: none, a speed round's
    ``better`` wins on speed alone),
    ``quality_repeats`` trials per arm; ``target_run_id``: the long-running job the winner is
    promoted into. ``min_effect``, ``equivalence``, ``loss_margin``: as ``ExperimentSpec``'s."""

    name: str
    precisions: tuple[str, ...] = ("fp32", "bf16")
    compressions: tuple[dict[str, Any], ...] = ({"method": "none"}, {"method": "int8"})
    bucket_mb: tuple[float, ...] = ()
    steps: int = TUNE_STEPS
    max_rounds: int = 3
    block_steps: int = 20
    warmup_steps: int = 3
    loss_margin: float = 0.05
    repeats: int = 2  # forked rounds (bucket sizes)
    overrides: dict[str, Any] = field(default_factory=dict)
    target_run_id: int | None = None
    min_effect: float = 0.02
    # Fixed, not left to the node as an experiment's may be: a speed round's band from its
    # budget and the noise (+-19% at 10 pairs) calls a 7-13% faster arm "no difference"
    # and drops it (bench/tuner.py: found-best 88% -> 58%); futility (min_effect) drops
    # the useless ones instead.
    equivalence: float = 0.02
    quality_steps: int = TUNE_QUALITY_STEPS
    quality_repeats: int = TUNE_QUALITY_REPEATS
    # search the mesh shape too (dp x tp x pp of the job's world size), first, in forked rounds
    mesh: bool = False


@dataclass(frozen=True, slots=True)
class AutotuneInfo:
    id: int
    name: str
    state: str  # running | done | failed | cancelled
    best: dict[str, Any] | None  # {"precision", "compression", "bucket_mb"}
    infeasible: list[dict[str, Any]]  # {"candidate", "reason"}
    rounds: list[dict[str, Any]]  # finished rounds, then the one in flight (verdicts None)
    error: str | None
    target_run_id: int | None
    config_hash: str
    versions: dict[str, str]
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class PromotionView:
    id: int
    run_id: int
    autotune_id: int | None
    seq: int | None  # None: no control message was sent (unchanged, or refused evidence)
    state: str  # contracts/states.py PROMOTION_STATES
    setting: dict[str, Any]
    previous: dict[str, Any]
    evidence: dict[str, Any]
    applied_step: int | None
    reason: str | None
    created_at: datetime
    applied_at: datetime | None
    ended_at: datetime | None
    # What it rests on: the target job's config hash (of its basis, daemon/provenance.py) and
    # versions, and its evidence's; None: not recorded (no evidence, or a row from before).
    config_hash: str | None = None
    versions: dict[str, str] | None = None
    evidence_config_hash: str | None = None
    evidence_versions: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class QueuedTrial:
    """A trial waiting in the queue, in claim order."""

    id: int
    experiment_id: int
    experiment: str
    arm: str
    repeat: int
    priority: int


class ProfileRefused(FieldErrors):
    """A profile cannot be asked for: a field's value (its path in ``errors``: a 422), or,
    with ``conflict``, the run's state (a capture under way, not started yet: a 409)."""

    def __init__(self, errors: Iterable[FieldError] | str, *, conflict: bool = False) -> None:
        super().__init__(errors)
        self.conflict = conflict

    @property
    def field(self) -> str | None:
        """The field the first problem is about (None: the run's state)."""
        loc = self.errors[0][0] if self.errors else ()
        return str(loc[0]) if loc else None


def rank_list(text: str | None) -> list[int] | None:
    """Ranks as a person types them (``"0, 2"``, ``"0 2"``; empty: every rank, None): the
    run page's profile form and ``traind profile --ranks``. FieldErrors naming ``ranks``."""
    if not text or not text.strip():
        return None
    try:
        ranks = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise FieldErrors.at(("ranks",), "rank numbers separated by commas, or empty for "
                             "every rank") from None
    if any(r < 0 for r in ranks) or len(ranks) > MAX_RANKS:
        raise FieldErrors.at(("ranks",), f"rank numbers, 0 or more (at most {MAX_RANKS} of "
                             "them)")
    return ranks


@dataclass(frozen=True, slots=True)
class Capture:
    """A profile captured on demand (daemon/profiles/), as the pages and the API show it."""

    run: int
    capture: int
    steps: int
    ranks: tuple[int, ...]  # the ranks asked for (every rank when none were named)
    requested: float  # unix
    state: str  # waiting | analysing | ready | failed | incomplete
    traces: tuple[int, ...]  # ranks whose trace is on this node
    error: str | None = None
    first_step: int | None = None
    last_step: int | None = None


class NodeService(Protocol):
    def runs(self, *, limit: int = PAGE, offset: int = 0, query: RunQuery | None = None
             ) -> list[RunView]:
        """One page of runs, newest first or as ``query`` sorts and filters them (blocking:
        call it from the threadpool)."""
        ...

    def count_runs(self, query: RunQuery | None = None) -> int:
        """How many runs ``query`` matches (all without one; blocking)."""
        ...

    def run_detail(self, run_id: int) -> RunDetail | None:
        """One run for its page; None for no such run (blocking)."""
        ...

    def run_series(self, run_id: int, *, points: int, ranks: bool = False,
                   comm: bool = False, after: int | None = None) -> dict[str, Any] | None:
        """The run's stored step series, downsampled to at most ``points`` per line with a
        min/max envelope, its evaluations, per-layer norms and precision switches
        (``daemon/runs/series_page.py``); ``ranks``: also ``"ranks"``, a line per rank of
        what differs between ranks and each rank's medians (empty for a run of one rank);
        ``comm``: also ``"comm"``, per op its calls, bandwidth and latency percentiles over
        steps, and the bytes raw and sent (empty for a run of one rank); ``after``: only
        what came since step ``after``, at full resolution (a poll's tail). None for no
        such run (blocking)."""
        ...

    def run_export(self, run_id: int) -> list[list[Any]] | None:
        """The run's stored steps at full resolution as CSV rows, header first (blocking)."""
        ...

    async def stop_run(self, run_id: int) -> bool:
        """Ask a running run to checkpoint and exit (it ends at its next step boundary);
        False if it is not running on this node."""
        ...

    async def probe_links(self, run_id: int) -> bool:
        """Ask a running multi-rank run to measure its rank-to-rank links again at its next
        report step; False if it is not running on this node or has one rank."""
        ...

    async def request_profile(self, run_id: int, *, steps: int,
                              ranks: list[int] | None = None) -> Capture | None:
        """Ask a running run to trace ``steps`` steps on ``ranks`` (every rank: None) from its
        next report step; None if it is not running on this node. Refused (ProfileRefused,
        naming the field) while a capture is under way or for a rank the job lacks."""
        ...

    def profiles(self, run_id: int) -> list[Capture] | None:
        """The run's captures, newest first (None: no such run). Blocking (reads files)."""
        ...

    def profile(self, run_id: int, capture: int
                ) -> tuple[Capture, dict[str, Any] | None] | None:
        """A capture and its report (None until built); None: no such capture. Blocking."""
        ...

    def profile_trace(self, run_id: int, capture: int, rank: int) -> Path | None:
        """The file of ``rank``'s trace in ``capture`` (None: there is none). Blocking."""
        ...

    def live_snapshot(self, run: int | None = None) -> dict[str, Any]:
        """Run ``run``'s live series held in memory (None: the newest run's), as sent first
        on a websocket (see daemon/ingest/hub.py)."""
        ...

    def subscribe(self) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Live messages as they arrive, through a bounded queue that drops the oldest."""
        ...

    def comm_history(self, run: int | None = None) -> dict[str, Any]:
        """Run ``run``'s communication over time held in memory (None: the newest run's):
        latency percentiles per op and the probe's bus bandwidth per message size
        (daemon/ingest/comm_history.py). In memory: read it on the event loop."""
        ...

    def hardware_history(self) -> dict[str, Any]:
        """The node's host and GPU figures over the last hour, sampled every few seconds
        (daemon/ingest/hardware_history.py). In memory: read it on the event loop."""
        ...

    def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The Prometheus exposition (body, content type) for a scrape."""
        ...

    def samples(self, prefix: str) -> list[MetricSample]:
        """Current values of the exported series whose name starts with ``prefix``, as a
        scrape would show them (blocking: collectors read hardware; use the threadpool)."""
        ...

    async def submit_experiment(self, spec: ExperimentSpec) -> ExperimentInfo:
        """Validate, record and start an experiment. ``ValueError`` (a ConfigError, whose
        ``errors`` are ``traind.errors``' ``(loc, msg)`` pairs) names each bad field; nothing
        is recorded then."""
        ...

    def experiments(self, *, limit: int = PAGE, offset: int = 0) -> list[ExperimentInfo]:
        """One page of experiments, newest first (blocking)."""
        ...

    def experiment(self, experiment_id: int) -> ExperimentInfo | None:
        """One experiment with its verdict so far (blocking)."""
        ...

    def experiment_evidence(self, experiment_id: int) -> ExperimentEvidence | None:
        """What its verdict rests on: blocks or trials, each arm's means, its progress; None
        for no such experiment (blocking)."""
        ...

    async def cancel_experiment(self, experiment_id: int) -> bool:
        """Mark it cancelled and ask its job to checkpoint and exit at its next step boundary
        (without waiting for the exit); False if it had already ended."""
        ...

    async def submit_autotune(self, spec: AutotuneSpec) -> AutotuneInfo:
        """Validate, record and start a search; ``ValueError`` names each bad field."""
        ...

    def autotunes(self, *, limit: int = PAGE, offset: int = 0) -> list[AutotuneInfo]:
        """One page of searches, newest first (blocking)."""
        ...

    def autotune(self, tune_id: int) -> AutotuneInfo | None:
        """One search with its rounds so far (blocking)."""
        ...

    async def cancel_autotune(self, tune_id: int) -> bool:
        """Stop the search (and its round's experiment); False if it had already ended."""
        ...

    def promotions(self, run_id: int | None = None, *, limit: int = PAGE, offset: int = 0
                   ) -> list[PromotionView]:
        """One page of promotions, newest first, of one run or all (blocking)."""
        ...

    def queued_trials(self, *, limit: int = PAGE, offset: int = 0) -> list[QueuedTrial]:
        """One page of the trials waiting to be claimed, in claim order (blocking)."""
        ...

    def reorder_trials(self, trial_ids: list[int]) -> None:
        """Claim these waiting trials in this order; ``ValueError`` for an id that is not a
        waiting trial (nothing changes then). Blocking."""
        ...

    def check_token(self, token: str | None) -> bool:
        """Whether ``token`` is the daemon's (required for every state-changing request)."""
        ...

    def health(self) -> dict[str, Any]:
        """Readiness: ``{"ok": bool, ...}``."""
        ...
