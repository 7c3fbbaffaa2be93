"""JSON shapes of the API, separate from the daemon's views so the wire format is explicit."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from traind.daemon.service import ExperimentInfo, ExperimentSpec, RunView


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
        return cls.model_validate(run)


class SampleOut(BaseModel):
    """One exported series' current value, as a scrape shows it (counters end in _total)."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    labels: dict[str, str]
    value: float


# Gradient compression methods the web form offers (trainer.compression's registry has them
# all; the API accepts any ``compression`` table and the daemon validates it).
METHODS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
Precision = Literal["fp32", "bf16", "fp16"]  # fp16 only in forked mode (checked by the daemon)


class ArmIn(BaseModel):
    """One arm: a name, the ``compression`` fields it changes, and its precision."""

    model_config = ConfigDict(extra="forbid")

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

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, examples=["int8-vs-none"])
    steps: int = Field(gt=0, description="The budget, in optimizer steps.")
    block_steps: int = Field(default=20, gt=0, description="Steps per block of one arm.")
    warmup_steps: int = Field(default=3, ge=0, description="Steps of each block not measured.")
    loss_margin: float = Field(default=0.05, ge=0,
                               description="How much worse an arm's loss may be (relative).")
    overrides: dict[str, Any] = Field(
        default_factory=dict, examples=[{"model.n_layers": 2}],
        description="Base-config fields by dotted path.")
    arms: list[ArmIn] = Field(min_length=2, max_length=8,
                              description="The first arm is the baseline.")
    mode: Literal["interleaved", "forked"] = Field(default="interleaved")
    repeats: int = Field(default=2, ge=1, le=50, description="forked: trials per arm.")
    checkpoint: str | None = Field(default=None, description="forked: the checkpoint every "
                                   "trial starts from; null = train a short base job first.")

    def spec(self) -> ExperimentSpec:
        return ExperimentSpec(
            name=self.name,
            arms=tuple(a.model_dump() for a in self.arms),
            steps=self.steps,
            block_steps=self.block_steps,
            warmup_steps=self.warmup_steps,
            loss_margin=self.loss_margin,
            overrides=dict(self.overrides),
            mode=self.mode,
            repeats=self.repeats,
            checkpoint=self.checkpoint,
        )


class ExperimentOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    state: str = Field(description="queued | running | done | cancelled | failed")
    mode: str
    arms: list[str] = Field(description="Baseline first.")
    run_id: int | None = Field(description="The job that runs it: /api/runs, /runs.")
    verdict: dict[str, dict[str, Any]] | None = Field(
        description="Per non-baseline arm: kind, ratio, low, high, p_value, reason, ...")
    config_hash: str
    versions: dict[str, str]
    created_at: datetime
    finished_at: datetime | None

    _utc = field_validator("created_at", "finished_at")(_utc)

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


class ErrorOut(BaseModel):
    detail: str
