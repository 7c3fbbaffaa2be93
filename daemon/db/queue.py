"""The experiment queue in the database: experiments, their arms, and the trials workers claim.

Promise: every trial runs at least once and its result is committed exactly once. A worker
claims a trial with a lease and an attempt number; it heartbeats to keep the lease; when the
lease runs out (the worker died or hung) the next claim takes the trial again as attempt + 1,
and from then on the old attempt's heartbeat, result and failure are refused. Every write is
one short transaction with a condition on (state, attempt), so a late or repeated call changes
nothing and says so by returning False.

Locking, per backend:
- PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED`` inside the claiming UPDATE, so concurrent
  claimers each lock a different row instead of queueing behind (or double-taking) the first.
- SQLite has no row locks: the whole claim runs inside ``BEGIN IMMEDIATE``, which takes the
  database's write lock before the first read, so no other writer can take the same row between
  our read and our write, and a busy writer waits (the engine's 30 s busy timeout) instead of
  failing on a read-to-write lock upgrade with SQLITE_BUSY.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, insert, or_, select, update
from sqlalchemy.orm import Session

from traind.contracts.states import EXPERIMENT_ACTIVE, TRIAL_STATES
from traind.daemon.db.models import Arm, Experiment, Run, Trial
from traind.daemon.provenance import config_hash
from traind.errors import FieldErrors

MODES = ("interleaved", "forked", "multinode")  # multinode: daemon/experiments/cluster.py
DEFAULT_OBJECTIVE: dict[str, Any] = {
    "metric": "tokens_per_second", "higher_is_better": True, "quality_margin": 0.01,
}


@dataclass(frozen=True, slots=True)
class ClaimedTrial:
    """What a worker needs to run a trial, and the attempt its calls back must quote."""

    trial_id: int
    experiment_id: int
    arm_id: int
    overrides: dict[str, Any]
    attempt: int
    repeat: int
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class TrialView:
    id: int
    experiment_id: int
    arm_id: int
    arm_name: str
    repeat: int
    state: str
    attempt: int
    priority: int
    lease_owner: str | None
    result: dict[str, Any] | None
    error: str | None


@dataclass(frozen=True, slots=True)
class ExperimentView:
    id: int
    name: str
    state: str
    mode: str
    base_config: dict[str, Any]
    objective: dict[str, Any]
    budget: dict[str, Any]
    verdict: dict[str, Any] | None
    arms: tuple[dict[str, Any], ...]  # {"id", "name", "overrides", "is_baseline"} by position
    config_hash: str
    versions: dict[str, str]  # traind, torch, device
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    run_id: int | None = None  # an interleaved experiment's job
    trial_runs: tuple[int, ...] = ()  # a forked one's: the run of each trial that ran, in order


def balanced_order(n_arms: int, repeats: int) -> list[tuple[int, int]]:
    """``(arm index, repeat)`` pairs, arms in order on even repeats and reversed on odd ones:
    A B B A A B B A for two arms. Drift over time (thermal throttling, a noisy neighbour)
    then hits every arm equally on average, where all-A-then-all-B would credit it to one arm."""
    order: list[tuple[int, int]] = []
    for r in range(repeats):
        arms = range(n_arms) if r % 2 == 0 else range(n_arms - 1, -1, -1)
        order.extend((a, r) for a in arms)
    return order


def create_experiment(
    engine: Engine, *, name: str, mode: str, base_config: dict[str, Any],
    arms: Sequence[Mapping[str, Any]], objective: dict[str, Any] | None = None,
    budget: dict[str, Any], repeats: int = 1, traind_version: str, torch_version: str,
    device: str, done: Mapping[tuple[int, int], dict[str, Any]] | None = None,
) -> int:
    """Stores the experiment, its arms (``{"name", "overrides", "baseline"}``; the first arm
    is the baseline when none says so) and ``len(arms) * repeats`` waiting trials in balanced
    order, queued after every trial already there. ``done``: (arm index, repeat) -> a result
    that trial already has (``daemon/experiments/reuse.py``): it is stored done, never run.
    Raises ``ValueError`` naming the field."""
    # A/B modes compare arms; a multi-node job is one setting run as one slot per node.
    specs = _check_arms(arms, least=1 if mode == "multinode" else 2)
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    objective = {**DEFAULT_OBJECTIVE, **(objective or {})}
    definition = {"mode": mode, "base_config": base_config, "arms": specs,
                  "objective": objective, "budget": budget, "repeats": repeats}
    digest = config_hash(definition)
    with _write(engine) as conn:
        if engine.dialect.name == "postgresql":
            # Serialises creators, so two experiments submitted at once do not share the
            # same priority numbers (their trials would interleave with each other's).
            conn.execute(select(func.pg_advisory_xact_lock(0x7472_6169)))
        exp_id = conn.execute(insert(Experiment).values(
            name=name, state="queued", mode=mode, base_config=base_config, objective=objective,
            budget=budget, config_hash=digest, traind_version=traind_version,
            torch_version=torch_version, device=device,
        ).returning(Experiment.id)).scalar_one()
        arm_ids = [
            conn.execute(insert(Arm).values(
                experiment_id=exp_id, position=i, **spec,
            ).returning(Arm.id)).scalar_one()
            for i, spec in enumerate(specs)
        ]
        first = (conn.execute(select(func.max(Trial.priority))).scalar() or 0) + 1
        done = done or {}
        now = _utc(None)
        conn.execute(insert(Trial), [
            {"experiment_id": exp_id, "arm_id": arm_ids[a], "repeat": r, "attempt": 0,
             "priority": first + i, "state": "done" if (a, r) in done else "waiting",
             "result": done.get((a, r)), "finished_at": now if (a, r) in done else None}
            for i, (a, r) in enumerate(balanced_order(len(arm_ids), repeats))
        ])
    return int(exp_id)


def claim(
    engine: Engine, *, owner: str, lease_seconds: float, experiment_id: int | None = None,
    mode: str | None = None, max_attempts: int = 3, now: datetime | None = None,
) -> ClaimedTrial | None:
    """Takes the waiting trial with the lowest (priority, id), or one whose lease expired,
    and marks it running as ``owner``'s next attempt. None when nothing is claimable.
    ``experiment_id`` restricts the claim to one experiment (an interleaved job's blocks),
    ``mode`` to experiments of that mode (``multinode``: node slots of cluster jobs).
    A trial whose lease ran out ``max_attempts`` times is failed instead: it likely kills
    its worker, and retrying it forever would stall the queue."""
    now = _utc(now)
    expired = and_(Trial.state == "running", Trial.lease_expires_at < now)
    claimable = or_(Trial.state == "waiting", and_(expired, Trial.attempt < max_attempts))
    pick = select(Trial.id).where(claimable)
    if experiment_id is not None:
        pick = pick.where(Trial.experiment_id == experiment_id)
    if mode is not None:
        pick = pick.where(Trial.experiment_id.in_(
            select(Experiment.id).where(Experiment.mode == mode)))
    # SKIP LOCKED: a row another claimer has locked (and is about to take) is passed over,
    # not waited for. SQLite's compiler drops FOR UPDATE; BEGIN IMMEDIATE does the job there.
    pick = pick.order_by(Trial.priority, Trial.id).limit(1).with_for_update(skip_locked=True)
    expires = now + timedelta(seconds=lease_seconds)
    with _write(engine) as conn:
        conn.execute(update(Trial).where(expired, Trial.attempt >= max_attempts).values(
            state="failed", finished_at=now, lease_expires_at=None,
            error=f"lease expired on each of {max_attempts} attempts (worker lost)"))
        # One conditional UPDATE: ``claimable`` is tested again on the row being written, so
        # even without the lock a trial that stopped being claimable is never taken twice.
        row = conn.execute(
            update(Trial)
            .where(Trial.id == pick.scalar_subquery(), claimable)
            .values(state="running", attempt=Trial.attempt + 1, lease_owner=owner,
                    lease_expires_at=expires, heartbeat_at=now, started_at=now,
                    result=None, error=None)
            .returning(Trial.id, Trial.experiment_id, Trial.arm_id, Trial.attempt,
                       Trial.repeat)
        ).one_or_none()
        if row is None:
            return None
        overrides = conn.execute(select(Arm.overrides).where(Arm.id == row.arm_id)).scalar_one()
        conn.execute(update(Experiment)
                     .where(Experiment.id == row.experiment_id, Experiment.state == "queued")
                     .values(state="running", started_at=now))
    return ClaimedTrial(trial_id=row.id, experiment_id=row.experiment_id, arm_id=row.arm_id,
                        overrides=dict(overrides), attempt=row.attempt, repeat=row.repeat,
                        lease_expires_at=expires)


def heartbeat(
    engine: Engine, *, trial_id: int, attempt: int, owner: str, lease_seconds: float,
    now: datetime | None = None,
) -> bool:
    """Extends the lease; False when the trial is no longer this owner's attempt (reclaimed
    after its lease ran out, or cancelled): the worker should then stop."""
    now = _utc(now)
    return _changed(engine, update(Trial).where(
        Trial.id == trial_id, Trial.attempt == attempt, Trial.lease_owner == owner,
        Trial.state == "running",
    ).values(heartbeat_at=now, lease_expires_at=now + timedelta(seconds=lease_seconds)))


def complete(
    engine: Engine, *, trial_id: int, attempt: int, result: dict[str, Any],
    now: datetime | None = None,
) -> bool:
    """Commits the result if ``attempt`` is the trial's current, still running attempt.
    False (and nothing written) for an outdated attempt, a repeat call or a cancelled trial."""
    return _finish(engine, trial_id, attempt, _utc(now), state="done", result=result)


def fail(
    engine: Engine, *, trial_id: int, attempt: int, error: str, now: datetime | None = None,
) -> bool:
    """Marks the current attempt failed, with the same refusals as ``complete``."""
    return _finish(engine, trial_id, attempt, _utc(now), state="failed", error=error)


def cancel_experiment(engine: Engine, *, experiment_id: int, now: datetime | None = None) -> int:
    """Cancels the experiment and its waiting and running trials (a running worker learns it
    from its next heartbeat, and its result is refused). Returns how many trials."""
    now = _utc(now)
    with _write(engine) as conn:
        conn.execute(update(Experiment)
                     .where(Experiment.id == experiment_id,
                            Experiment.state.in_(EXPERIMENT_ACTIVE))
                     .values(state="cancelled", finished_at=now))
        res = conn.execute(update(Trial)
                           .where(Trial.experiment_id == experiment_id,
                                  Trial.state.in_(("waiting", "running")))
                           .values(state="cancelled", finished_at=now))
        return int(res.rowcount or 0)


def finish_experiment(
    engine: Engine, *, experiment_id: int, verdict: dict[str, Any], state: str = "done",
    now: datetime | None = None,
) -> bool:
    """Stores the verdict of a queued or running experiment and cancels its trials still
    waiting or running (a test that stops early leaves some). False if it had already ended."""
    if state not in ("done", "failed"):
        raise ValueError(f"state: must be done or failed, got {state!r}")
    now = _utc(now)
    with _write(engine) as conn:
        ended = conn.execute(update(Experiment).where(
            Experiment.id == experiment_id, Experiment.state.in_(EXPERIMENT_ACTIVE),
        ).values(state=state, verdict=verdict, finished_at=now)).rowcount == 1
        if ended:
            conn.execute(update(Trial)
                         .where(Trial.experiment_id == experiment_id,
                                Trial.state.in_(("waiting", "running")))
                         .values(state="cancelled", finished_at=now))
        return bool(ended)


def link_run(engine: Engine, *, experiment_id: int, run_id: int) -> None:
    """Names the job an interleaved experiment runs in."""
    with _write(engine) as conn:
        conn.execute(update(Experiment).where(Experiment.id == experiment_id)
                     .values(run_id=run_id))


def set_live_verdict(engine: Engine, *, experiment_id: int, verdict: dict[str, Any]) -> bool:
    """The verdict so far of a running experiment, on its row (the one home of an
    experiment's verdict; :func:`finish_experiment` writes the last). False if it ended
    meanwhile: a late write never overwrites the final verdict."""
    with _write(engine) as conn:
        return conn.execute(update(Experiment).where(
            Experiment.id == experiment_id, Experiment.state == "running",
        ).values(verdict=verdict)).rowcount == 1


def stranded_interleaved(engine: Engine, *, node: str) -> list[int]:
    """Running interleaved experiments whose job, on ``node``, neither runs nor can resume:
    their daemon died (a SIGKILL, a power cut) before the job saved a checkpoint."""
    with engine.connect() as conn:
        return [int(i) for i in conn.execute(
            select(Experiment.id).join(Run, Run.id == Experiment.run_id)
            .where(Experiment.mode == "interleaved", Experiment.state == "running",
                   Run.node == node, Run.state.not_in(("running", "preempted")))
            .order_by(Experiment.id)).scalars()]


def preempted_interleaved(engine: Engine, *, node: str
                          ) -> list[tuple[int, int, dict[str, Any], str]]:
    """``(experiment id, run id, run config, run folder)`` of every running interleaved
    experiment whose job on ``node`` was preempted (it resumes from its checkpoint)."""
    with engine.connect() as conn:
        return [(int(e), int(r), dict(c), str(d)) for e, r, c, d in conn.execute(
            select(Experiment.id, Run.id, Run.config, Run.out_dir)
            .join(Run, Run.id == Experiment.run_id)
            .where(Experiment.mode == "interleaved", Experiment.state == "running",
                   Run.node == node, Run.state == "preempted")
            .order_by(Experiment.id))]


def requeue(engine: Engine, *, experiment_id: int) -> bool:
    """A running experiment back to the queue, to start over in a new job: its trials wait
    again and its verdict so far goes (it was its lost job's). False if it was not running."""
    with _write(engine) as conn:
        if conn.execute(update(Experiment).where(
                Experiment.id == experiment_id, Experiment.state == "running",
        ).values(state="queued", run_id=None, verdict=None, started_at=None)).rowcount != 1:
            return False
        conn.execute(update(Trial).where(
            Trial.experiment_id == experiment_id, Trial.state == "running",
        ).values(state="waiting", lease_owner=None, lease_expires_at=None, heartbeat_at=None,
                 started_at=None))
        return True


def reorder(engine: Engine, *, trial_ids_in_order: Sequence[int]) -> None:
    """Claims the given waiting trials in this order: they swap the priority slots they
    already hold, so trials not named keep their place relative to them. Raises
    ``FieldErrors`` (a ValueError) for an id that is not a waiting trial (and changes
    nothing)."""
    ids = list(trial_ids_in_order)
    if len(set(ids)) != len(ids):
        raise FieldErrors.at(("trial_ids_in_order",), "an id appears twice")
    with _write(engine) as conn:
        held = dict(conn.execute(select(Trial.id, Trial.priority).where(
            Trial.id.in_(ids), Trial.state == "waiting")).all())
        missing = [i for i in ids if i not in held]
        if missing:
            raise FieldErrors.at(("trial_ids_in_order",), f"not waiting trials: {missing}")
        for trial_id, slot in zip(ids, sorted(held.values()), strict=True):
            conn.execute(update(Trial).where(Trial.id == trial_id).values(priority=slot))


def queue_depth(engine: Engine) -> dict[str, int]:
    """Trials per state, every state present (0 when none)."""
    with engine.connect() as conn:
        counts = dict(conn.execute(
            select(Trial.state, func.count()).group_by(Trial.state)).all())
    return {s: int(counts.get(s, 0)) for s in TRIAL_STATES}


def list_experiments(engine: Engine, *, limit: int = 50, offset: int = 0
                     ) -> list[ExperimentView]:
    """One page of experiments, newest first."""
    with engine.connect() as conn:
        ids = conn.execute(select(Experiment.id).order_by(Experiment.id.desc())
                           .limit(limit).offset(offset)).scalars().all()
    return [v for i in ids if (v := get_experiment(engine, experiment_id=i)) is not None]


def experiment_ids(engine: Engine, *, mode: str, states: Sequence[str]) -> list[int]:
    """Every experiment of ``mode`` in one of ``states``, oldest first, however many there
    are (a restart resumes them all; a free slot starts the oldest queued one)."""
    with engine.connect() as conn:
        return [int(i) for i in conn.execute(
            select(Experiment.id).where(Experiment.mode == mode, Experiment.state.in_(states))
            .order_by(Experiment.id)).scalars()]


def waiting_trials(engine: Engine, *, limit: int, offset: int = 0
                   ) -> list[tuple[TrialView, str]]:
    """One page of the waiting trials in claim order, each with its experiment's name."""
    stmt = (select(Trial, Arm.name, Experiment.name).join(Arm, Arm.id == Trial.arm_id)
            .join(Experiment, Experiment.id == Trial.experiment_id)
            .where(Trial.state == "waiting").order_by(Trial.priority, Trial.id)
            .limit(limit).offset(offset))
    with Session(engine) as s:
        return [(_trial_view(t, arm), name) for t, arm, name in s.execute(stmt)]


def lease_expiries(engine: Engine) -> int:
    """Claims that took a trial over from an expired lease: each one raised the trial's
    attempt past 1 (``attempt - 1`` per trial), so the sum only grows, like a counter."""
    with engine.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.sum(Trial.attempt - 1), 0))
                                .where(Trial.attempt > 1)).scalar_one())


def experiments_by_state(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {s: int(n) for s, n in conn.execute(
            select(Experiment.state, func.count()).group_by(Experiment.state)).all()}


def get_experiment(engine: Engine, *, experiment_id: int) -> ExperimentView | None:
    with Session(engine) as s:
        e = s.get(Experiment, experiment_id)
        if e is None:
            return None
        arms = s.scalars(select(Arm).where(Arm.experiment_id == experiment_id)
                         .order_by(Arm.position))
        results = s.scalars(select(Trial.result).where(Trial.experiment_id == experiment_id)
                            .order_by(Trial.priority, Trial.id))
        runs = tuple(r["run_id"] for r in results
                     if isinstance(r, dict) and isinstance(r.get("run_id"), int))
        return ExperimentView(
            id=e.id, name=e.name, state=e.state, mode=e.mode, base_config=e.base_config,
            objective=e.objective, budget=e.budget, verdict=e.verdict,
            arms=tuple({"id": a.id, "name": a.name, "overrides": a.overrides,
                        "is_baseline": a.is_baseline} for a in arms),
            config_hash=e.config_hash,
            versions={"traind": e.traind_version, "torch": e.torch_version, "device": e.device},
            created_at=_aware(e.created_at), started_at=_aware(e.started_at),
            finished_at=_aware(e.finished_at), run_id=e.run_id, trial_runs=runs,
        )


def list_trials(engine: Engine, *, experiment_id: int | None = None) -> list[TrialView]:
    """Trials in claim order (priority, id), with their arm's name."""
    stmt = (select(Trial, Arm.name).join(Arm, Arm.id == Trial.arm_id)
            .order_by(Trial.priority, Trial.id))
    if experiment_id is not None:
        stmt = stmt.where(Trial.experiment_id == experiment_id)
    with Session(engine) as s:
        return [_trial_view(t, name) for t, name in s.execute(stmt)]


# ---- private ----


def _trial_view(t: Trial, arm_name: str) -> TrialView:
    return TrialView(id=t.id, experiment_id=t.experiment_id, arm_id=t.arm_id,
                     arm_name=arm_name, repeat=t.repeat, state=t.state, attempt=t.attempt,
                     priority=t.priority, lease_owner=t.lease_owner, result=t.result,
                     error=t.error)


def _check_arms(arms: Sequence[Mapping[str, Any]], *, least: int) -> list[dict[str, Any]]:
    if len(arms) < least:
        raise ValueError(f"arms: an experiment needs at least {least} arms")
    specs: list[dict[str, Any]] = []
    for i, arm in enumerate(arms):
        name = str(arm.get("name", "")).strip()
        if not name:
            raise ValueError(f"arms[{i}].name: required")
        if any(s["name"] == name for s in specs):
            raise ValueError(f"arms[{i}].name: {name!r} is used twice")
        overrides = arm.get("overrides", {})
        if not isinstance(overrides, Mapping):
            raise ValueError(f"arms[{i}].overrides: must be a mapping")
        specs.append({"name": name, "overrides": dict(overrides),
                      "is_baseline": bool(arm.get("baseline", False))})
    n_base = sum(s["is_baseline"] for s in specs)
    if n_base > 1:
        raise ValueError("arms: only one arm can be the baseline")
    if n_base == 0:
        specs[0]["is_baseline"] = True
    return specs


@contextmanager
def _write(engine: Engine) -> Iterator[Connection]:
    """One write transaction. On SQLite it is started with ``BEGIN IMMEDIATE``: this is
    SQLAlchemy's documented pysqlite recipe (turn the driver's own implicit BEGIN off, emit
    ours), done per connection through the AUTOCOMMIT isolation level, which sets the driver's
    ``isolation_level = None`` and is reset when the connection goes back to the pool, so the
    shared engine is left untouched. The driver's default would BEGIN only before the first
    write, after our read, letting two claimers read the same row."""
    if engine.dialect.name != "sqlite":
        with engine.begin() as conn:
            yield conn
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.exec_driver_sql("COMMIT")
        except BaseException:
            if conn.connection.driver_connection.in_transaction:  # type: ignore[union-attr]
                conn.exec_driver_sql("ROLLBACK")
            raise


def _changed(engine: Engine, stmt: Any) -> bool:
    with _write(engine) as conn:
        return bool(conn.execute(stmt).rowcount == 1)


def _finish(engine: Engine, trial_id: int, attempt: int, now: datetime, **values: Any) -> bool:
    # The (state, attempt) condition is what makes results exactly-once: the first call moves
    # the row out of ``running``, so a repeat matches nothing; a reclaimed trial has a newer
    # attempt, so the old worker's call matches nothing either.
    return _changed(engine, update(Trial).where(
        Trial.id == trial_id, Trial.attempt == attempt, Trial.state == "running",
    ).values(finished_at=now, lease_expires_at=None, **values))


def _aware(t: Any) -> Any:
    # SQLite hands back naive datetimes for timezone-aware columns; all we store is UTC.
    return t.replace(tzinfo=UTC) if isinstance(t, datetime) and t.tzinfo is None else t


def _utc(now: datetime | None) -> datetime:
    # SQLite stores timestamps as naive text compared as strings: everything must be UTC.
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("now: must be timezone-aware")
    return now.astimezone(UTC)
