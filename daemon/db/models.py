"""Database tables (SQLAlchemy 2). API schemas are separate: see ``daemon.service.RunView``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    out_dir: Mapped[str] = mapped_column(String(1024), default="")
    # job (resumed after a preemption) | experiment (an interleaved A/B job) | trial (a forked
    # experiment's: its runner re-runs it, so the node must not resume it as well)
    kind: Mapped[str] = mapped_column(String(16), default="job", server_default="job")
    # The daemon that runs it (daemon.node_addr or the host name): in a cluster every node
    # writes to one database, and a restarting daemon must only touch its own runs.
    node: Mapped[str] = mapped_column(String(255), default="", server_default="", index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class RunEvent(Base):
    """Evaluations and lifecycle events of a run (step events stay in memory and Prometheus:
    one row per step would make the database the bottleneck of a fast job)."""

    __tablename__ = "run_events"
    __table_args__ = (Index("ix_run_events_run_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    rank: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer)
    value: Mapped[float | None] = mapped_column(Float)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Experiment(Base):
    """An A/B experiment: a base job config, two or more arms, an objective and a budget.
    The version columns make a verdict reproducible: what ran, on what, with which code."""

    __tablename__ = "experiments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    mode: Mapped[str] = mapped_column(String(16))  # interleaved | forked
    base_config: Mapped[dict[str, Any]] = mapped_column(JSON)
    # {"metric": "tokens_per_second", "higher_is_better": true, "quality_margin": 0.01}
    objective: Mapped[dict[str, Any]] = mapped_column(JSON)
    # {"steps": ..} or {"minutes": ..}, plus "max_trials" (forked) or "max_blocks" (interleaved)
    budget: Mapped[dict[str, Any]] = mapped_column(JSON)
    verdict: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    config_hash: Mapped[str] = mapped_column(String(64))
    traind_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(256))
    # The job an interleaved experiment runs in (forked ones have a run per trial instead).
    # No foreign key: see migration 0005 (runs are never deleted, so it cannot dangle).
    run_id: Mapped[int | None] = mapped_column(Integer, index=True)


class Arm(Base):
    """One setting under test: overrides applied on top of the experiment's base config."""

    __tablename__ = "arms"
    __table_args__ = (UniqueConstraint("experiment_id", "name", name="uq_arms_experiment_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    overrides: Mapped[dict[str, Any]] = mapped_column(JSON)
    is_baseline: Mapped[bool] = mapped_column(Boolean, default=False)
    position: Mapped[int] = mapped_column(Integer)


class Trial(Base):
    """One unit of queued work (a short forked job, or one block of an interleaved one).
    ``attempt`` counts claims: a result is accepted only from the current attempt."""

    __tablename__ = "trials"
    # The claim query filters on state and takes the lowest (priority, id): one index serves it.
    __table_args__ = (Index("ix_trials_claim", "state", "priority", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    arm_id: Mapped[int] = mapped_column(ForeignKey("arms.id", ondelete="CASCADE"), index=True)
    repeat: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="waiting")
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[int] = mapped_column(Integer)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Autotune(Base):
    """An auto-tuning search: its space, the candidates left out (and why), and the plan
    (``daemon/autotune.Plan``: rounds, verdicts, the best so far) stored after every round, so
    a restarted daemon goes on from the last finished round."""

    __tablename__ = "autotunes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default="running", index=True)
    space: Mapped[dict[str, Any]] = mapped_column(JSON)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # overrides, budget, margins, target
    infeasible: Mapped[list[Any]] = mapped_column(JSON)  # [{"candidate", "reason"}]
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    best: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    target_run_id: Mapped[int | None] = mapped_column(Integer)  # promoted into when done
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    config_hash: Mapped[str] = mapped_column(String(64))
    traind_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(256))


class Promotion(Base):
    """A setting handed to a running job at its next checkpoint boundary, with the evidence
    that chose it and the setting it replaced, so that it can be shown and rolled back.
    ``state``: pending -> applied -> kept | rolled_back (or pending -> superseded); a row that
    sent nothing is born ended: ``unchanged`` or ``refused``."""

    __tablename__ = "promotions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(Integer, index=True)
    autotune_id: Mapped[int | None] = mapped_column(Integer)
    # the control message's number for this run; None: no message was sent (nothing beat
    # the baseline, the run already had the setting, or its evidence was refused)
    seq: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    setting: Mapped[dict[str, Any]] = mapped_column(JSON)  # {"precision", "compression"}
    previous: Mapped[dict[str, Any]] = mapped_column(JSON)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)  # the verdicts that chose it
    applied_step: Mapped[int | None] = mapped_column(Integer)
    rollback_seq: Mapped[int | None] = mapped_column(Integer)  # the control message undoing it
    reason: Mapped[str | None] = mapped_column(Text)  # why it was kept, undone or not sent
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    applied_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # What it rests on (daemon/provenance.py): the target job's config hash (of its basis)
    # and versions, and those of the evidence that chose it (None: no measured evidence).
    config_hash: Mapped[str | None] = mapped_column(String(64))
    versions: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    evidence_config_hash: Mapped[str | None] = mapped_column(String(64))
    evidence_versions: Mapped[dict[str, Any] | None] = mapped_column(JSON)
