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
    # An interleaved experiment's run resumes (its runner resumes it, with its blocks); a
    # forked trial is its runner's to run again, never the node's.
    assert states == {"job": "preempted", "bare": "stopped", "exp": "preempted",
                      "trial": "stopped"}
    assert crud.preempted_runs(engine) == [(ids["job"], {"n": "job"}, "with-ckpt")]
    assert crud.preempted_runs(engine, kind="experiment") == [
        (ids["exp"], {"n": "exp"}, "with-ckpt")]


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


@pytest.fixture(params=["sqlite", "postgres"])
def any_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return _url(tmp_path)
    return str(request.getfixturevalue("fresh_postgres_url"))


def test_the_runs_table_filters_by_experiment_and_config_key(any_url: str):
    """The same answers on SQLite and PostgreSQL: a config value matched by its JSON type
    (a number as a number, a string as a string, never a failing cast), and an experiment's
    runs through its job and its trials' results."""
    from traind.daemon.db import queue
    from traind.daemon.service import config_match

    upgrade(any_url)
    engine = make_engine(any_url)
    configs = [
        {"precision": {"mode": "bf16"}, "compression": {"method": "powersgd", "rank": 4}},
        {"precision": {"mode": "fp32"}, "compression": {"method": "none", "rank": "4"}},
        {"precision": {"mode": "bf16"}, "compression": {"method": "int8", "rank": 4.0},
         "job": {"compile": True, "tag": None}},
        {"precision": {"mode": 2}, "job": {"compile": False}},  # a number where others have text
        {},
    ]
    ids = [crud.create_run(engine, name=f"r{i}", config=c) for i, c in enumerate(configs, 1)]
    versions = {"traind_version": "0.test", "torch_version": "2.13.0", "device": "cpu"}
    forked = queue.create_experiment(
        engine, name="forked", mode="forked", base_config={}, repeats=1,
        arms=[{"name": "A", "overrides": {}, "baseline": True}, {"name": "B", "overrides": {}}],
        objective={}, budget={"steps": 10}, **versions)
    interleaved = queue.create_experiment(
        engine, name="inter", mode="interleaved", base_config={}, repeats=1,
        arms=[{"name": "A", "overrides": {}, "baseline": True}, {"name": "B", "overrides": {}}],
        objective={}, budget={"steps": 10}, **versions)
    queue.link_run(engine, experiment_id=interleaved, run_id=ids[0])
    for run_id in (ids[1], ids[2]):  # forked's two trials ran as runs 2 and 3
        claimed = queue.claim(engine, owner="t", lease_seconds=60)
        assert claimed is not None and claimed.experiment_id == forked
        assert queue.complete(engine, trial_id=claimed.trial_id, attempt=claimed.attempt,
                              result={"run_id": run_id, "tokens_per_second": 1.0})

    def found(**kw: object) -> list[int]:
        q = RunQuery(sort="id", descending=False, **kw)  # type: ignore[arg-type]
        got = [r.id for r in crud.list_runs(engine, query=q)]
        assert crud.count_runs(engine, query=q) == len(got)
        return got

    def where(text: str, **kw: object) -> list[int]:
        return found(config=config_match(text), **kw)

    assert found(experiment=forked) == [2, 3] and found(experiment=interleaved) == [1]
    assert found(experiment=999) == []
    assert where("precision.mode=bf16") == [1, 3]
    assert where("precision.mode=bf16", experiment=forked) == [3]
    assert where("compression.method=powersgd") == [1]
    assert where("precision.mode=2") == [4]  # the number; no cast of "bf16" fails
    assert where("compression.rank=4") == [1, 2, 3]  # 4, the string "4" and 4.0
    assert where("compression.rank=4.0") == [1, 3]  # a number only: "4" is not "4.0"
    assert where("job.compile=true") == [3] and where("job.compile=false") == [4]
    assert where("job.tag=null") == [3]
    assert where("precision=bf16") == []  # an object is no string
    assert where("no.such.key=1") == []
    assert where("precision.mode=") == []
    assert where("precision.mode=bf16' OR 1=1 --") == []  # a value, bound, never SQL
    # The roles the run page shows come from the same rule.
    assert [e["role"] for e in crud.run_experiments(engine, run_id=ids[2])] == ["trial"]
    assert [e["role"] for e in crud.run_experiments(engine, run_id=ids[0])] == ["interleaved"]
    engine.dispose()


@pytest.mark.parametrize(("text", "error"), [
    ("precision.mode", "key=value"),
    ("precision..mode=x", "dotted names"),
    ("$.a=1", "dotted names"),
    ("a[0]=1", "dotted names"),
    ("../etc/passwd=1", "dotted names"),
    ("a.b.c.d.e.f.g.h.i=1", "at most 8 parts"),
    ("a=" + "x" * 300, "at most 200"),
])
def test_a_config_filter_refuses_what_is_not_a_dotted_key(text: str, error: str):
    from traind.daemon.service import config_match

    with pytest.raises(ValueError, match=error):
        config_match(text)


def test_a_config_filter_reads_key_and_value():
    from traind.daemon.service import ConfigMatch, config_match

    assert config_match(" precision.mode = bf16 ") == ConfigMatch(("precision", "mode"), "bf16")
    assert config_match("job.name=a=b").value == "a=b"  # the first = splits
    assert str(config_match("compression.method=powersgd")) == "compression.method=powersgd"
