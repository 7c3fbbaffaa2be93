from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from traind.daemon.db import autotunes, crud
from traind.daemon.db.engine import make_engine
from traind.daemon.db.migrate import downgrade, upgrade
from traind.daemon.db.models import Base
from traind.daemon.service import RunQuery


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 't.db'}"


def test_upgrade_matches_models_and_downgrade_empties(tmp_path: Path):
    url = _url(tmp_path)
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations drifted: {diff}"
    assert {"runs", "run_events"} <= set(inspect(engine).get_table_names())
    downgrade(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(url)  # and back up again
    assert "runs" in inspect(engine).get_table_names()


def test_sqlite_runs_in_wal_mode(tmp_path: Path):
    engine = make_engine(_url(tmp_path))
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_run_lifecycle_and_events(tmp_path: Path):
    url = _url(tmp_path)
    upgrade(url)
    engine = make_engine(url)
    rid = crud.create_run(engine, name="a", config={"job": {"steps": 3}})
    crud.mark_running(engine, run_id=rid)
    crud.add_events(engine, run_id=rid, events=[
        {"kind": "eval", "step": 10, "value": 2.5, "data": {"batches": 2}},
        {"kind": "checkpoint", "step": 10, "data": {"path": "x"}},
    ])
    crud.update_summary(engine, run_id=rid, summary={"step": 10, "loss": 2.0})
    crud.mark_finished(engine, run_id=rid, state="failed", exit_code=1, error="boom")
    (view,) = crud.list_runs(engine)
    assert (view.state, view.exit_code, view.error, view.summary["step"]) == (
        "failed", 1, "boom", 10)
    assert view.finished_at is not None and view.finished_at.tzinfo is not None
    evals = crud.run_events(engine, run_id=rid, kind="eval")
    assert [(e["step"], e["value"]) for e in evals] == [(10, 2.5)]


def test_interrupted_runs_are_preempted_when_they_can_resume_else_stopped(tmp_path: Path):
    url = _url(tmp_path)
    upgrade(url)
    engine = make_engine(url)
    ids = {}
    for name, kind, out in (("job", "job", "with-ckpt"), ("bare", "job", "empty"),
                            ("exp", "experiment", "with-ckpt"), ("trial", "trial", "with-ckpt")):
        ids[name] = crud.create_run(engine, name=name, config={"n": name}, out_dir=out,
                                    kind=kind)
        crud.mark_running(engine, run_id=ids[name])
    assert crud.mark_interrupted(engine, resumable=lambda d: d == "with-ckpt") == 4
    states = {n: crud.get_run(engine, run_id=i).state for n, i in ids.items()}
    # Experiment jobs and forked trials are their runners' to re-run, never the node's.
    assert states == {"job": "preempted", "bare": "stopped", "exp": "stopped",
                      "trial": "stopped"}
    assert crud.preempted_runs(engine) == [(ids["job"], {"n": "job"}, "with-ckpt")]


def test_an_autotune_row_keeps_what_the_user_saw(tmp_path: Path):
    """A round saved after a cancel changes nothing; a failed search keeps its best so far."""
    url = _url(tmp_path)
    upgrade(url)
    engine = make_engine(url)
    fields = dict(space={}, submitted={"name": "t"}, infeasible=[], plan={"rounds": []},
                  target_run_id=None, config_hash="h", traind_version="v",
                  torch_version="t", device="cpu")
    one = autotunes.create_autotune(engine, name="one", **fields)
    two = autotunes.create_autotune(engine, name="two", **fields)
    assert autotunes.running_autotunes(engine) == [one, two]
    autotunes.save_round(engine, tune_id=one, plan={"rounds": [{"r": 1}]}, current={"r": 2},
                         best={"name": "fp32"})
    found = autotunes.progress(engine, tune_id=one)
    assert found == autotunes.Progress("running", {"name": "t"}, {"rounds": [{"r": 1}]},
                                       {"r": 2})
    autotunes.end_autotune(engine, tune_id=one, state="failed", error="boom")
    autotunes.end_autotune(engine, tune_id=two, state="cancelled")
    autotunes.save_round(engine, tune_id=two, plan={"rounds": [{"r": 1}]}, current=None,
                         best={"name": "bf16"})
    info = {t.id: t for t in autotunes.list_autotunes(engine)}
    assert (info[one].state, info[one].error, info[one].best) == ("failed", "boom",
                                                                  {"name": "fp32"})
    assert info[one].rounds == [{"r": 1}, {"r": 2}] and info[one].finished_at is not None
    assert (info[two].state, info[two].best, info[two].rounds) == ("cancelled", None, [])
    assert autotunes.running_autotunes(engine) == []
    assert autotunes.get_autotune(engine, tune_id=99) is None


def test_the_runs_table_query_filters_sorts_and_pages(tmp_path: Path):
    url = _url(tmp_path)
    upgrade(url)
    engine = make_engine(url)
    losses = [3.0, None, 1.0, 2.0, 1.0]
    names = ["base", "int8_a", "int8%b", "Big-INT8", "fp32"]
    for i, (name, loss) in enumerate(zip(names, losses, strict=True)):
        rid = crud.create_run(engine, name=name, config={})
        crud.update_summary(engine, run_id=rid, summary={} if loss is None else {"loss": loss})
        if i % 2:
            crud.mark_running(engine, run_id=rid)

    def ids(q: RunQuery, **kw: int) -> list[int]:
        return [r.id for r in crud.list_runs(engine, query=q, **kw)]

    assert ids(RunQuery()) == [5, 4, 3, 2, 1]  # newest first
    # A summary figure through its JSON path: ties newest first, runs without it last.
    assert ids(RunQuery(sort="loss", descending=False)) == [5, 3, 4, 1, 2]
    assert ids(RunQuery(sort="loss")) == [1, 4, 5, 3, 2]
    assert ids(RunQuery(sort="name", descending=False)) == [1, 4, 5, 3, 2]  # any case
    assert ids(RunQuery(state="running")) == [4, 2]
    assert ids(RunQuery(name="int8")) == [4, 3, 2]  # any case
    assert ids(RunQuery(name="8%")) == [3] and ids(RunQuery(name="8_")) == [2]  # literal
    assert ids(RunQuery(sort="loss", descending=False), limit=2, offset=2) == [4, 1]
    assert crud.count_runs(engine, query=RunQuery(name="int8")) == 3
    assert crud.count_runs(engine) == 5
    with pytest.raises(ValueError, match="sort: one of"):
        crud.list_runs(engine, query=RunQuery(sort="config"))
