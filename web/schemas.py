"""JSON shapes of the API, separate from the daemon's views so the wire format is explicit."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from traind.contracts.control import PROFILE_STEPS_MAX
from traind.contracts.states import PROMOTION_STATES
from traind.daemon.service import (
    COMPRESSION_METHODS,
    MAX_RANKS,
    TUNE_QUALITY_REPEATS,
    TUNE_QUALITY_STEPS,
    TUNE_STEPS,
    AutotuneInfo,
    AutotuneSpec,
    Capture,
    ExperimentInfo,
    ExperimentSpec,
    PromotionView,
    QueuedTrial,
    RunView,
)


def _utc(t: datetime | None) -> datetime | None:
    # SQLite returns naive datetimes (written in UTC); without an offset a browser's
    # Date.parse would read them as local time.
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    state: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None
    summary: dict[str, Any]

    _utc = field_validator("created_at", "started_at", "finished_at")(_utc)

    @classmethod
    def of(cls, run: RunView) -> RunOut:
        """The run as the API shows it to any reader: the newest checkpoint by its file name
        (in the run's own folder), not the node's absolute path."""
        out = cls.model_validate(run)
        if isinstance(ckpt := out.summary.get("last_checkpoint"), str):
            out.summary = {**out.summary, "last_checkpoint": PurePath(ckpt).name}
        return out


class SampleOut(BaseModel):
    """One exported series' current value, as a scrape shows it (counters end in _total)."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    labels: dict[str, str]
    value: float


# Gradient compression methods the web form offers (trainer.compression's registry has them
# all; the API accepts any ``compression`` table and the daemon validates it).
METHODS = COMPRESSION_METHODS
Precision = Literal["fp32", "bf16", "fp16"]  # fp16 only in forked mode (checked by the daemon)


# Request bodies are strict (JSON true is not a step count, "5" is not an int: a form converts
# its strings before it validates) and finite (NaN, Infinity and 1e400 are 422, never 500).
IN_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
INT64_MAX = 2**63 - 1  # the database's integer: a larger id would overflow there (a 500)
MAX_STEPS = 10_000_000  # optimizer steps of one experiment: weeks of training at 10 steps/s
Id = Annotated[int, Field(ge=1, le=INT64_MAX)]
# The verdict's settings as the API documents them (trainer.config.InterleaveConfig declares
# them; the web layer does not import the trainer).
LOSS_MARGIN = ("The quality guard's margin, ABSOLUTE in nats of loss (not relative): an arm's "
               "loss may sit at most this far above the baseline's (0.05: 2.00 vs 2.05 passes).")
MIN_EFFECT = ("The smallest speed-up worth having, relative (0.02 = 2%): the sequential test "
              "stops for futility once an arm cannot reach it.")
EQUIVALENCE = ('The "no difference" band, relative (0.02 = +-2%). Left out (null): the '
               "narrowest band an A/A reaches in this budget at the node's measured noise, "
               "stored with the experiment. A fixed band tighter than the noise needs many "
               "pairs: the experiment form says how many.")

TUNE_EQUIVALENCE = ('The "no difference" band of every round, relative (0.02 = +-2%). Fixed, '
                    "not chosen from the noise as an experiment's may be: a band as wide as a "
                    "short round's noise would drop arms that are faster by less than it.")


class ArmIn(BaseModel):
    """One arm: a name, the ``compression`` fields it changes, and its precision."""

    model_config = IN_CONFIG

    name: str = Field(min_length=1, max_length=100, examples=["int8"])
    compression: dict[str, Any] = Field(
        default_factory=dict, examples=[{"method": "int8"}],
        description="compression.* fields for this arm; {} keeps the base config's.")
    precision: Precision | None = Field(
        default=None, description="fp32 or bf16 (fp16 too in forked mode); null keeps the "
        "base config's.")


class ExperimentIn(BaseModel):
    """An A/B experiment. interleaved: the arms alternate in blocks inside one job; forked:
    each arm runs ``repeats`` short jobs from the same checkpoint, interleaved in time."""

    model_config = IN_CONFIG

    name: str = Field(min_length=1, max_length=200, examples=["int8-vs-none"])
    steps: int = Field(gt=0, le=MAX_STEPS, description="The budget, in optimizer steps.")
    block_steps: int = Field(default=20, gt=0, le=MAX_STEPS,
                             description="Steps per block of one arm.")
    warmup_steps: int = Field(default=3, ge=0, le=MAX_STEPS,
                              description="Steps of each block not measured.")
    loss_margin: float = Field(default=0.05, ge=0, le=1, description=LOSS_MARGIN)
    min_effect: float = Field(default=0.02, gt=0, lt=1, description=MIN_EFFECT)
    equivalence: float | None = Field(default=None, gt=0, lt=1, description=EQUIVALENCE)
    overrides: dict[str, Any] = Field(
        default_factory=dict, examples=[{"model.n_layers": 2}],
        description="Base-config fields by dotted path.")
    arms: list[ArmIn] = Field(min_length=2, max_length=8,
                              description="The first arm is the baseline.")
    mode: Literal["interleaved", "forked"] = Field(default="interleaved")
    repeats: int = Field(default=2, ge=1, le=50, description="forked: trials per arm.")
    # Ids, never a path: loading a checkpoint unpickles it. The daemon resolves them to
    # <var_dir>/runs/<run>/step_<8 digits>.pt of a run it knows (422 naming the field if not).
    checkpoint_run: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="forked: the run whose checkpoint every "
        "trial starts from (see /api/runs); null = train a short base job first.")
    checkpoint_step: int | None = Field(
        default=None, ge=0, le=99_999_999, validate_default=True,
        description="forked: the step of that run's checkpoint; given with checkpoint_run.")

    @field_validator("checkpoint_step")
    @classmethod
    def _with_run(cls, step: int | None, info: ValidationInfo) -> int | None:
        # Only when checkpoint_run itself was valid (else it is in data neither way).
        if "checkpoint_run" in info.data and (info.data["checkpoint_run"] is None) != (
                step is None):
            raise ValueError("give checkpoint_run and checkpoint_step together")
        return step

    def spec(self) -> ExperimentSpec:
        return ExperimentSpec(
            name=self.name,
            arms=tuple(a.model_dump() for a in self.arms),
            steps=self.steps,
            block_steps=self.block_steps,
            warmup_steps=self.warmup_steps,
            loss_margin=self.loss_margin,
            min_effect=self.min_effect,
            equivalence=self.equivalence,
            overrides=dict(self.overrides),
            mode=self.mode,
            repeats=self.repeats,
            checkpoint_run=self.checkpoint_run,
            checkpoint_step=self.checkpoint_step,
        )


class _Recorded(BaseModel):
    """What every stored experiment and search carries: its name, and how it can be traced
    back (the hash of its configuration and the versions it ran with)."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    config_hash: str
    versions: dict[str, str]
    created_at: datetime
    finished_at: datetime | None

    _utc = field_validator("created_at", "finished_at")(_utc)


class ExperimentOut(_Recorded):
    state: str = Field(description="queued | running | done | cancelled | failed")
    mode: str
    arms: list[str] = Field(description="Baseline first.")
    run_id: int | None = Field(description="The job that runs it: /api/runs, /runs.")
    verdict: dict[str, dict[str, Any]] | None = Field(
        description="Per non-baseline arm: kind, ratio, low, high, p_value, reason, ...")
    equivalence: float | None = Field(
        default=None, description='The "no difference" band it runs with (relative).')
    equivalence_rule: str | None = Field(
        default=None, description="How the node chose that band when the submission left it "
                                  "out; null when the submission set it.")

    @classmethod
    def of(cls, info: ExperimentInfo) -> ExperimentOut:
        return cls.model_validate(info)


class VerdictRow(BaseModel):
    """One arm's verdict against the baseline, as exported (CSV columns in this order)."""

    arm: str
    kind: str
    ratio: float | None = None
    low: float | None = None
    high: float | None = None
    p_value: float | None = None
    reason: str = ""
    interval: str = Field(default="", description="What low..high is: a 95% always-valid "
                          "confidence sequence (interleaved) or t interval (forked); p_value "
                          "is the same test's.")


class ErrorOut(BaseModel):
    detail: str


# --- auto-tuning, promotions and the queue ----------------------------------------------------

# Precisions the auto-tune form offers; fp16 and fp8 are accepted so the daemon can leave them
# out with its reason (they cannot switch inside a running job, fp8 needs the hardware).
TUNE_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
TunePrecision = Literal["fp32", "bf16", "fp16", "fp8"]


class CompressionIn(BaseModel):
    """One compression candidate: a method and its ``compression.*`` parameters."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    method: str = Field(min_length=1, max_length=50, examples=["powersgd"],
                        description="none, fp16, bf16, int8, topk, powersgd, ...; other keys "
                        "are its compression.* fields, e.g. powersgd_rank.")


class AutotuneIn(BaseModel):
    """An auto-tuning search: stage by stage (the mesh shape if asked, then precision, then
    compression at that precision, then the combinations the two stages did not try, then
    bucket size), each round an A/B experiment against the best so far."""

    model_config = IN_CONFIG

    name: str = Field(min_length=1, max_length=200, examples=["tune-small"])
    precisions: list[TunePrecision] = Field(default=["fp32", "bf16"], min_length=1, max_length=8,
                                  examples=[["fp32", "bf16"]])
    compressions: list[CompressionIn] = Field(
        default_factory=lambda: [CompressionIn(method="none"), CompressionIn(method="int8")],
        min_length=1, max_length=32,
        examples=[[{"method": "none"}, {"method": "powersgd", "powersgd_rank": 4}]],
        description='"none" is always included: it is the baseline.')
    bucket_mb: list[Annotated[float, Field(gt=0, le=4096)]] = Field(
        default_factory=list, max_length=16,
        description="DDP bucket sizes to try last (forked rounds).")
    mesh: bool = Field(default=False, description="Search the mesh shape first: every dp x tp "
                       "x pp of the job's world size that the mesh rules accept for its model "
                       "(forked rounds, each arm at the job's global batch); the later stages "
                       "search on the winner's mesh. Nothing to try with one rank.")
    steps: int = Field(default=TUNE_STEPS, gt=0, le=MAX_STEPS, description="A stage's first "
                       "round's budget in steps per two arms (a round of k arms runs k/2 "
                       "times as many); each later round of a stage doubles it.")
    max_rounds: int = Field(default=3, ge=1, le=20, description="Rounds per stage at most.")
    block_steps: int = Field(default=20, gt=0, le=MAX_STEPS)
    warmup_steps: int = Field(default=3, ge=0, le=MAX_STEPS)
    loss_margin: float = Field(default=0.05, ge=0, le=1, description=LOSS_MARGIN)
    repeats: int = Field(default=2, ge=1, le=50, description="forked rounds: trials per arm.")
    overrides: dict[str, Any] = Field(default_factory=dict, examples=[{"model.n_layers": 2}])
    target_run_id: Id | None = Field(
        default=None, description="A running job the winner is promoted into; null: none.")
    min_effect: float = Field(default=0.02, gt=0, lt=1, description=MIN_EFFECT)
    equivalence: float = Field(default=0.02, gt=0, lt=1, description=TUNE_EQUIVALENCE)
    quality_steps: int = Field(
        default=TUNE_QUALITY_STEPS, ge=0, le=MAX_STEPS, description="Steps per forked trial of "
        "a stage's first quality round (each arm that won a speed round, on its own weights "
        "from one checkpoint; later quality rounds double it). 0: none, a speed win is enough.")
    quality_repeats: int = Field(default=TUNE_QUALITY_REPEATS, ge=1, le=50,
                                 description="Quality rounds: trials per arm.")

    def spec(self) -> AutotuneSpec:
        return AutotuneSpec(
            name=self.name,
            precisions=tuple(self.precisions),
            compressions=tuple(c.model_dump() for c in self.compressions),
            bucket_mb=tuple(self.bucket_mb),
            mesh=self.mesh,
            steps=self.steps,
            max_rounds=self.max_rounds,
            block_steps=self.block_steps,
            warmup_steps=self.warmup_steps,
            loss_margin=self.loss_margin,
            repeats=self.repeats,
            overrides=dict(self.overrides),
            target_run_id=self.target_run_id,
            min_effect=self.min_effect,
            equivalence=self.equivalence,
            quality_steps=self.quality_steps,
            quality_repeats=self.quality_repeats,
        )


class AutotuneOut(_Recorded):
    state: str = Field(description="running | done | failed | cancelled")
    best: dict[str, Any] | None = Field(
        description="The best setting so far: precision, compression, bucket_mb.")
    infeasible: list[dict[str, Any]] = Field(
        description="Candidates left out: {candidate, reason}.")
    rounds: list[dict[str, Any]] = Field(
        description="Per round: stage, index, baseline, challengers, steps, experiment_id, "
        "verdicts (challenger -> kind, ratio, low, high, reason; null while it runs).")
    error: str | None
    target_run_id: int | None

    @classmethod
    def of(cls, info: AutotuneInfo) -> AutotuneOut:
        return cls.model_validate(info)


class PromotionOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    run_id: int
    autotune_id: int | None
    seq: int | None = Field(description="The control message's number; null: nothing was "
                            "sent (unchanged, or evidence refused).")
    state: str = Field(description=" | ".join(PROMOTION_STATES) + ". unchanged: nothing sent "
                       "(nothing beat the baseline, or the run already had the setting); "
                       "refused: by the job, or evidence from another configuration.")
    setting: dict[str, Any]
    previous: dict[str, Any]
    evidence: dict[str, Any]
    applied_step: int | None
    reason: str | None
    created_at: datetime
    applied_at: datetime | None
    ended_at: datetime | None
    config_hash: str | None = Field(None, description="The target job's config hash (of "
                                    "the fields evidence must share: model, batch, ranks, "
                                    "device, parallel layout); null: not recorded.")
    versions: dict[str, str] | None = Field(None, description="traind, torch, device of the "
                                            "target job.")
    evidence_config_hash: str | None = Field(None, description="The same hash of the "
                                             "experiments that chose it; null: none.")
    evidence_versions: dict[str, str] | None = Field(None, description="Their versions.")

    _utc = field_validator("created_at", "applied_at", "ended_at")(_utc)

    @classmethod
    def of(cls, p: PromotionView) -> PromotionOut:
        return cls.model_validate(p)


class QueuedTrialOut(BaseModel):
    """A trial waiting to be claimed; the list is in claim order."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    experiment_id: int
    experiment: str
    arm: str
    repeat: int
    priority: int

    @classmethod
    def of(cls, t: QueuedTrial) -> QueuedTrialOut:
        return cls.model_validate(t)


class ReorderIn(BaseModel):
    """Waiting trials in the order they should be claimed; those not named keep their place
    relative to these."""

    model_config = IN_CONFIG

    trial_ids: list[Id] = Field(min_length=1, max_length=10_000, examples=[[7, 5, 6]])


# ---- communication and hardware over time (the daemon's in-memory buffers) ----------------

Floats = list[float | None]  # aligned with the entry's ``time``; null where nothing was seen


class LatencySeriesOut(BaseModel):
    """One op's collective latency per time slot, every rank and message size together."""

    op: str = Field(description="all_reduce, all_gather, reduce_scatter, ...")
    time: list[float] = Field(description="Unix seconds: the newest report in the slot.")
    step: list[int] = Field(description="The newest optimizer step reported in the slot.")
    calls: list[int] = Field(description="Collectives timed in the slot.")
    p50: Floats = Field(description="Median latency, seconds, from the histogram buckets "
                        "of traind_comm_collective_latency_seconds (PromQL's interpolation).")
    p95: Floats = Field(description="95th percentile, seconds (as p50).")
    p99: Floats = Field(description="99th percentile, seconds (as p50).")


class ProbeSeriesOut(BaseModel):
    """One op and message size of the all-reduce probe (telemetry.probe_every; 0 = off)."""

    op: str
    size_bytes: int
    time: list[float] = Field(description="Unix seconds of each probe.")
    step: list[int]
    latency: list[float] = Field(description="The slowest rank's median, seconds.")
    bus_bandwidth: list[float] = Field(description="Bytes/s, nccl-tests factors (as "
                                       "traind_comm_probe_bus_bandwidth_bytes_per_second).")


class MeshRankOut(BaseModel):
    rank: int
    dp: int
    tp: int
    pp: int


class MeshDimOut(BaseModel):
    """What one mesh dimension moved, per rank and optimizer step."""

    mesh_dim: str = Field(description="dp, tp or pp.")
    bytes_per_step: float = Field(description="Bytes handed to its collectives (pp: "
                                  "activation bytes sent between stages).")
    seconds_per_step: float | None = Field(description="Time some collective was in flight "
                                           "(pp: waited on its sends and receives; null: not "
                                           "timed).")
    calls_per_step: float = Field(description="Collectives (pp: P2P sends).")


class MeshStageOut(BaseModel):
    """A pipeline stage over its ranks' latest reports."""

    stage: int
    ranks: list[int]
    step: int
    bubble: float = Field(description="Idle share of the step, measured (0-1).")
    bubble_theory: float = Field(description="(p - 1) / (m + p - 1).")
    busy_seconds: float
    idle_seconds: float
    sent_forward_bytes: float = Field(description="Activation bytes a rank sent a step.")
    sent_backward_bytes: float = Field(description="Activation-gradient bytes a rank sent.")


class MeshOut(BaseModel):
    shape: dict[str, int] = Field(description="{dp, tp, pp}.")
    ranks: list[MeshRankOut]
    dims: list[MeshDimOut]
    stages: list[MeshStageOut]


class CommHistoryOut(BaseModel):
    run: int | None = Field(description="The run shown (null: no run has comm history).")
    runs: list[int] = Field(description="Runs with history held, newest first.")
    slot_seconds: float = Field(description="Width of a latency slot.")
    latency: list[LatencySeriesOut]
    probe: list[ProbeSeriesOut] = Field(description="Empty unless the run's config sets "
                                        "telemetry.probe_every (off by default).")
    mesh: MeshOut | None = Field(None, description="The run's device mesh, when it has tp "
                                 "or pp beyond 1 (null otherwise).")


class GpuSeriesOut(BaseModel):
    gpu: str = Field(description="NVML index.")
    name: str
    utilization: Floats = Field(description="0-1.")
    memory_used: Floats = Field(description="Bytes.")
    power: Floats = Field(description="Watts.")
    power_limit: Floats = Field(description="Watts.")
    pcie_tx: Floats = Field(description="Bytes/s, as NVML samples it.")
    pcie_rx: Floats = Field(description="Bytes/s.")
    nvlink_tx: Floats = Field(description="Bytes/s over all links, between two samples.")
    nvlink_rx: Floats = Field(description="Bytes/s.")


class HardwareHistoryOut(BaseModel):
    sample_seconds: float = Field(description="Time between samples.")
    capacity: int | None = Field(description="Samples held at most (older ones leave).")
    time: list[float] = Field(description="Unix seconds of each sample.")
    cpu: Floats = Field(description="Host CPU busy share, 0-1.")
    memory_used: Floats = Field(description="Host memory used, bytes.")
    memory_total: float | None = Field(description="Host memory, bytes.")
    gpu_collector: bool = Field(description="Whether the node reads GPUs (metrics.gpu).")
    gpu_devices: int = Field(description="GPUs NVML reported in the newest sample.")
    gpu_absent: str | None = Field(description="Why NVML sees no GPU, as it said.")
    gpus: list[GpuSeriesOut]


class ProfileIn(BaseModel):
    """A profile on demand: the steps to trace and, optionally, which ranks."""

    model_config = IN_CONFIG

    steps: int = Field(5, ge=1, le=PROFILE_STEPS_MAX, description=(
        "Steps to trace, from the run's next report step (a trace of a large model's step "
        "is tens of MB)."))
    ranks: list[Annotated[int, Field(ge=0, le=65_535)]] | None = Field(
        None, min_length=1, max_length=MAX_RANKS,
        description="Ranks to trace (every rank when left out).")


class CaptureOut(BaseModel):
    """A profile capture: ``state`` is waiting (for the run's next report step, or its ranks'
    traces), analysing, ready, failed (``error`` says why) or incomplete (the run or the
    daemon ended before it was)."""

    model_config = ConfigDict(from_attributes=True)

    run: int
    capture: int
    steps: int
    ranks: list[int]
    requested: float
    state: str
    traces: list[int]
    error: str | None
    first_step: int | None
    last_step: int | None
    report_url: str
    trace_urls: dict[str, str]

    @classmethod
    def of(cls, c: Capture) -> CaptureOut:
        base = f"/api/runs/{c.run}/profiles/{c.capture}"
        return cls(**dataclasses.asdict(c), report_url=f"/runs/{c.run}/profiles/{c.capture}",
                   trace_urls={str(r): f"{base}/traces/{r}" for r in c.traces})
