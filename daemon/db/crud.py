"""Keyword-only database operations on runs and their events. The daemon is the only caller
that writes; each function is one short transaction."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, func, or_, select, update
from sqlalchemy.orm import Session

from traind.daemon.db.json_match import json_equals
from traind.daemon.db.models import Experiment, Run, RunEvent, Trial, utcnow
from traind.daemon.service import RUN_SORT_KEYS, RunQuery, RunView

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence


def create_run(engine: Engine, *, name: str, config: dict[str, Any], out_dir: str = "",
               kind: str = "job", node: str = "") -> int:
    with Session(engine) as s, s.begin():
        run = Run(name=name, config=config, out_dir=out_dir, state="queued", summary={},
                  kind=kind, node=node)
        s.add(run)
        s.flush()
        return run.id


def set_out_dir(engine: Engine, *, run_id: int, out_dir: str) -> None:
    _update(engine, run_id, out_dir=out_dir)


def mark_running(engine: Engine, *, run_id: int) -> None:
    _update(engine, run_id, state="running", started_at=utcnow())


def mark_finished(
    engine: Engine, *, run_id: int, state: str, exit_code: int | None, error: str | None = None
) -> None:
    _update(engine, run_id, state=state, exit_code=exit_code, error=error, finished_at=utcnow())


def update_summary(engine: Engine, *, run_id: int, summary: dict[str, Any]) -> None:
    _update(engine, run_id, summary=summary)


# The kinds of run a restart resumes: a job, and an interleaved experiment's run (its runner
# resumes it with the blocks stored so far). A trial's run is its runner's to retry.
RESUMABLE = ("job", "experiment")


def mark_interrupted(engine: Engine, *, resumable: Callable[[str], bool], node: str = "") -> int:
    """Runs a previous daemon left ``running`` or ``queued``: their workers died with it (a
    SIGKILL of the daemon). Those whose folder holds a checkpoint (``resumable(out_dir)``)
    become ``preempted`` and resume at the next start; the rest ``stopped``. Returns how many."""
    with Session(engine) as s, s.begin():
        runs = list(s.scalars(select(Run).where(Run.state.in_(("queued", "running")),
                                                Run.node == node)))
        for run in runs:
            ok = run.kind in RESUMABLE and bool(run.out_dir) and resumable(run.out_dir)
            run.state = "preempted" if ok else "stopped"
            run.finished_at = utcnow()
            run.error = "daemon restarted" + (": resumes from its checkpoint" if ok else "")
        return len(runs)


def interrupted_runs(engine: Engine, *, node: str = "") -> list[tuple[int, str]]:
    """``(run id, out_dir)`` of the runs of ``node`` a previous daemon left ``running`` or
    ``queued`` with a folder (what :func:`mark_interrupted` ends), oldest first."""
    with Session(engine) as s:
        return [(r.id, r.out_dir) for r in s.scalars(
            select(Run).where(Run.state.in_(("queued", "running")), Run.node == node,
                              Run.out_dir != "").order_by(Run.id)) if r.out_dir]


def newest_chunks(engine: Engine, *, run_id: int, kind: str, n: int) -> list[dict[str, Any]]:
    """The ``data`` of the run's newest ``n`` events of ``kind``, newest first."""
    with Session(engine) as s:
        return [dict(d) for d in s.scalars(
            select(RunEvent.data).where(RunEvent.run_id == run_id, RunEvent.kind == kind)
            .order_by(RunEvent.id.desc()).limit(n))]


def event_keys(engine: Engine, *, run_id: int, since: int,
               exclude: Sequence[str] = ()) -> set[tuple[str, int, int]]:
    """``(kind, step, rank)`` of the run's events at step ``since`` or later, but those of
    the ``exclude`` kinds."""
    with Session(engine) as s:
        return {(k, st, r) for k, st, r in s.execute(
            select(RunEvent.kind, RunEvent.step, RunEvent.rank).where(
                RunEvent.run_id == run_id, RunEvent.step >= since,
                RunEvent.kind.not_in(exclude)))}


def add_recovered(engine: Engine, *, run_id: int, events: Sequence[dict[str, Any]],
                  summary: dict[str, Any]) -> None:
    """A killed daemon's lost events and the summary they give, in one transaction."""
    with Session(engine) as s, s.begin():
        s.add_all(_event_rows(run_id, events))
        if (run := s.get(Run, run_id)) is not None:
            run.summary = summary


def preempted_runs(engine: Engine, *, node: str = "", kind: str = "job"
                   ) -> list[tuple[int, dict[str, Any], str]]:
    """``(run id, config, out_dir)`` of every preempted run of ``node`` and ``kind``, oldest
    first."""
    with Session(engine) as s:
        return [(r.id, dict(r.config), r.out_dir) for r in s.scalars(
            select(Run).where(Run.state == "preempted", Run.kind == kind, Run.node == node)
            .order_by(Run.id))]


def add_events(engine: Engine, *, run_id: int, events: Iterable[dict[str, Any]]) -> None:
    """Each event: ``kind``, ``step``, optional ``rank``, ``value``, ``data``, ``time``."""
    if rows := _event_rows(run_id, events):
        with Session(engine) as s, s.begin():
            s.add_all(rows)


def run_events(engine: Engine, *, run_id: int, kind: str | None = None,
               kinds: Sequence[str] = (), since: int | None = None) -> list[dict[str, Any]]:
    """The run's events, oldest first: all, or those of ``kind`` (or of ``kinds``);
    ``since``: only those at that step or later."""
    stmt = select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.id)
    if kind:
        stmt = stmt.where(RunEvent.kind == kind)
    if kinds:
        stmt = stmt.where(RunEvent.kind.in_(kinds))
    if since is not None:
        stmt = stmt.where(RunEvent.step >= since)
    with Session(engine) as s:
        return [
            {"kind": e.kind, "rank": e.rank, "step": e.step, "value": e.value, "data": e.data,
             "time": e.time}
            for e in s.scalars(stmt)
        ]


def run_chunks(engine: Engine, *, run_id: int, kind: str, since: int | None = None
               ) -> list[dict[str, Any]]:
    """The ``data`` of the run's events of ``kind``, oldest first: the sealed series chunks
    (daemon/ingest/series.py) without the rest of each row. ``since``: only the chunks that
    may hold a step at or after it: a chunk's ``step`` is its first, so the newest chunk
    that starts before ``since`` and every chunk stored after it (a poll's tail reads a few
    rows, not the run)."""
    mine = (RunEvent.run_id == run_id, RunEvent.kind == kind)
    stmt = select(RunEvent.data).where(*mine).order_by(RunEvent.id)
    if since is not None:
        straddle = select(func.max(RunEvent.id)).where(*mine, RunEvent.step < since)
        stmt = stmt.where(or_(RunEvent.step >= since,
                              RunEvent.id >= func.coalesce(straddle.scalar_subquery(), 0)))
    with Session(engine) as s:
        return [dict(d) for d in s.scalars(stmt)]


def stream_chunks(engine: Engine, *, run_id: int, kind: str) -> Iterator[dict[str, Any]]:
    """The ``data`` of the run's events of ``kind``, newest first, fetched a few rows at a
    time: a whole page's read holds one chunk at a time, not the run."""
    stmt = (select(RunEvent.data).where(RunEvent.run_id == run_id, RunEvent.kind == kind)
            .order_by(RunEvent.id.desc()).execution_options(yield_per=32))
    with Session(engine) as s:
        for data in s.scalars(stmt):
            yield dict(data)


def first_step(engine: Engine, *, run_id: int, kind: str) -> int | None:
    """The first step of the run's events of ``kind`` (None: none stored)."""
    with Session(engine) as s:
        found = s.scalar(select(func.min(RunEvent.step)).where(
            RunEvent.run_id == run_id, RunEvent.kind == kind))
        return None if found is None else int(found)


def run_record(engine: Engine, *, run_id: int) -> dict[str, Any] | None:
    """What the run's page shows of the row beyond its view: kind, node, config, folder."""
    with Session(engine) as s:
        run = s.get(Run, run_id)
        if run is None:
            return None
        return {"kind": run.kind, "node": run.node, "config": dict(run.config),
                "out_dir": run.out_dir}


def run_experiments(engine: Engine, *, run_id: int) -> list[dict[str, Any]]:
    """The experiments run ``run_id`` served: the interleaved one it ran (its ``run_id``),
    and the forked ones one of whose trials it was (a trial's result names its run)."""
    with Session(engine) as s:
        found = {e.id: (e, "interleaved") for e in s.scalars(
            select(Experiment).where(Experiment.run_id == run_id))}
        for e in s.scalars(select(Experiment).where(Experiment.id.in_(
                select(Trial.experiment_id).where(_trial_run() == run_id)))):
            found.setdefault(e.id, (e, "trial"))
        return [{"id": e.id, "name": e.name, "state": e.state, "role": role}
                for e, role in sorted(found.values(), key=lambda t: t[0].id)]


def _trial_run() -> Any:
    """A trial's run: its result names it (daemon/experiments/forked.py; NULL until then)."""
    return Trial.result["run_id"].as_integer()


def _experiment_runs(experiment_id: int) -> Any:
    """Whether a run served experiment ``experiment_id``, as ``run_experiments`` finds it:
    the interleaved job it ran in, or one of its trials' runs."""
    return or_(
        Run.id.in_(select(Experiment.run_id).where(Experiment.id == experiment_id,
                                                   Experiment.run_id.is_not(None))),
        Run.id.in_(select(_trial_run()).where(Trial.experiment_id == experiment_id,
                                              _trial_run().is_not(None))))


def list_runs(engine: Engine, *, limit: int = 200, offset: int = 0,
              query: RunQuery | None = None) -> list[RunView]:
    """One page of runs, newest first, or as ``query`` filters and sorts them (a summary
    figure through its JSON path; runs without it last, then by id)."""
    q = query or RunQuery()
    key = _sort_column(q.sort)
    order = [key.is_(None), key.desc() if q.descending else key.asc(), Run.id.desc()]
    with Session(engine) as s:
        return [_view(r) for r in s.scalars(_filtered(select(Run), q).order_by(*order)
                                            .limit(limit).offset(offset))]


def count_runs(engine: Engine, *, query: RunQuery | None = None) -> int:
    with Session(engine) as s:
        return int(s.scalar(_filtered(select(func.count(Run.id)), query or RunQuery())) or 0)


def _filtered(stmt: Any, q: RunQuery) -> Any:
    if q.state:
        stmt = stmt.where(Run.state == q.state)
    if q.name:
        # A part of the name, any case; LIKE's wildcards in it are taken literally.
        escaped = q.name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(Run.name.ilike(f"%{escaped}%", escape="\\"))
    if q.experiment is not None:
        stmt = stmt.where(_experiment_runs(q.experiment))
    if q.config is not None:
        stmt = stmt.where(json_equals(Run.config[q.config.key], q.config.value))
    return stmt


def _sort_column(key: str) -> Any:
    if key not in RUN_SORT_KEYS:
        raise ValueError(f"sort: one of {', '.join(RUN_SORT_KEYS)}, not {key!r}")
    if key in ("step", "loss", "val_loss", "tokens_per_second"):
        return Run.summary[key].as_float()
    if key == "name":  # as people read names: any case together
        return func.lower(Run.name)
    return getattr(Run, key)


def get_run(engine: Engine, *, run_id: int) -> RunView | None:
    with Session(engine) as s:
        run = s.get(Run, run_id)
        return _view(run) if run else None


def run_config(engine: Engine, *, run_id: int) -> dict[str, Any] | None:
    """The TrainConfig the run was recorded with (as JSON), or None for no such run."""
    with Session(engine) as s:
        run = s.get(Run, run_id)
        return dict(run.config) if run else None


def _event_rows(run_id: int, events: Iterable[dict[str, Any]]) -> list[RunEvent]:
    return [RunEvent(run_id=run_id, kind=e["kind"], step=e["step"], rank=e.get("rank", 0),
                     value=e.get("value"), data=e.get("data", {}),
                     time=e.get("time") or utcnow()) for e in events]


def _update(engine: Engine, run_id: int, **values: Any) -> None:
    with Session(engine) as s, s.begin():
        s.execute(update(Run).where(Run.id == run_id).values(**values))


def _view(r: Run) -> RunView:
    return RunView(
        id=r.id, name=r.name, state=r.state, created_at=_aware(r.created_at),
        started_at=_aware(r.started_at), finished_at=_aware(r.finished_at),
        exit_code=r.exit_code, error=r.error, summary=dict(r.summary or {}),
    )


def _aware(t: datetime | None) -> Any:
    # SQLite returns naive datetimes for timezone-aware columns; everything we store is UTC.
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t
