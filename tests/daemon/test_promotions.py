"""Promotions: the guard's decisions (pure), their rows, and a rollback through a real job."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from traind.contracts.control import FILENAME, read_control
from traind.contracts.events import LifecycleEvent, StepEvent
from traind.daemon.db.engine import make_engine
from traind.daemon.db.migrate import upgrade
from traind.daemon.db.promotions import list_promotions, mark_applied
from traind.daemon.promotions import Guard, GuardPolicy, current_setting, end, promote

if TYPE_CHECKING:
    from pathlib import Path

def test_a_setting_changes_only_the_fields_it_names() -> None:
    from traind.daemon.promotions import changes

    now = {"precision": "fp32", "compression": {"method": "none", "int8_block": 256}}
    assert not changes(now, {"precision": "fp32", "compression": {"method": "none"}})
    assert not changes(now, {})
    assert changes(now, {"precision": "bf16"})
    assert changes(now, {"compression": {"method": "none", "int8_block": 128}})


def test_rows_follow_the_control_messages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    config = {"precision": {"mode": "fp32"}, "compression": {"method": "none"}}
    previous = current_setting(engine, 7, config)
    assert previous == {"precision": "fp32", "compression": {"method": "none"}}
    new = {"precision": "bf16", "compression": {"method": "int8"}}
    first = promote(engine, run_id=7, out_dir=tmp_path, setting=new, previous=previous,
                    evidence={"why": "test"})
    second = promote(engine, run_id=7, out_dir=tmp_path, setting=new, previous=previous,
                     evidence={"why": "test"})
    assert read_control(tmp_path / FILENAME).seq == 2  # the newest message wins
    rows = {p.id: p for p in list_promotions(engine, run_id=7)}
    assert rows[first].state == "superseded" and rows[second].state == "pending"
    view = mark_applied(engine, run_id=7, seq=2, step=40, error=None)
    assert view is not None and view.state == "applied" and view.applied_step == 40
    assert current_setting(engine, 7, config) == new
    end(engine, promotion_id=second, out_dir=tmp_path, action="rollback", reason="slowdown")
    control = read_control(tmp_path / FILENAME)
    assert control is not None and control.seq == 3 and control.setting == previous
    mark_applied(engine, run_id=7, seq=3, step=50, error=None)
    (row,) = [p for p in list_promotions(engine, run_id=7) if p.id == second]
    assert row.state == "rolled_back" and row.reason == "slowdown"
    assert current_setting(engine, 7, config) == previous


@pytest.mark.slow
def test_a_promotion_that_slows_the_job_is_rolled_back(tmp_path: Path) -> None:
    """A real job: a promoted setting applies at a checkpoint boundary, the guard sees the
    job slow down (forced here with a strict policy) and sends the previous setting back."""
    from traind.daemon.config import load_settings
    from traind.daemon.node import Node

    node = Node(load_settings(env={}, overrides=[
        "job.steps=400", "job.checkpoint_every=20", "job.eval_every=1000", "job.threads=1",
        "job.batch_size=4", "model.seq_len=32", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "data.max_bytes=200000", "daemon.default_job=false",
        f"daemon.var_dir={tmp_path}"]))
    node.migrate()
    # Forced: a rollback once the interval lies below 2x the speed before (tiny blocks).
    node.guard.policy = GuardPolicy(block=2, ref_blocks=5, settle=1, slowdown=-1.0)

    async def main() -> list[str]:
        rid = await node.submit(node.settings)
        while node.supervisor.summaries[rid].step < 25:
            await asyncio.sleep(0.05)
        pid = await node.service.promote(rid, {"precision": "bf16"}, evidence={"test": True})
        assert pid is not None
        seen = []
        for _ in range(600):
            states = {p.id: p.state for p in node.service.promotions(rid)}
            if not seen or seen[-1] != states[pid]:
                seen.append(states[pid])
            if states[pid] == "rolled_back":
                break
            await asyncio.sleep(0.1)
        await node.shutdown()
        return seen

    seen = asyncio.run(main())
    assert seen[-1] == "rolled_back", seen
    (row,) = node.service.promotions()
    assert row.reason is not None and "slowdown" in row.reason
    assert row.previous == {"precision": "fp32", "compression": row.previous["compression"]}


def _report(step: int, time: float) -> StepEvent:
    return StepEvent(rank=0, step=step, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=64,
                     step_seconds=0.01, data_seconds=0, forward_seconds=0,
                     backward_seconds=0, optimizer_seconds=0, time=time)


def test_the_guard_forgets_a_run_that_ended(tmp_path: Path) -> None:
    """A run's samples, speed and watch leave with it, also a watch whose promotion is
    confirmed only after the run ended; other runs' stay."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    setting = {"precision": "bf16", "compression": {"method": "none"}}
    for run in (7, 8):
        promote(engine, run_id=run, out_dir=tmp_path, setting=setting, previous=setting,
                evidence={})
    guard = Guard(engine, lambda _run: tmp_path)

    async def main() -> None:
        for run in (7, 8):
            guard.observe(run, LifecycleEvent(rank=0, phase="started", step=0,
                                              detail={"world_size": 2}))
            for step in range(1, 4):
                guard.observe(run, _report(step, 100.0 + step))
            guard.observe(run, LifecycleEvent(rank=0, phase="promoted", step=3,
                                              detail={"seq": 1}))
        guard.forget(8)  # ends before its promotion's row is read back
        await asyncio.gather(*guard._tasks)
        assert 7 in guard._watch
        guard.forget(7)

    asyncio.run(main())
    assert (guard._recent, guard._watch, guard._speed) == ({}, {}, {})


def test_a_message_that_cannot_be_written_leaves_no_row(tmp_path: Path) -> None:
    """The row and the control message agree: a failed write records no promotion and no
    rollback (the query calls ``send`` inside its transaction)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    setting = {"precision": "bf16", "compression": {"method": "none"}}
    blocked = tmp_path / "a-file"  # the run's folder cannot be made: a file is in the way
    blocked.write_text("")
    with pytest.raises(OSError):
        promote(engine, run_id=7, out_dir=blocked, setting=setting,
                previous=setting, evidence={})
    assert list_promotions(engine, run_id=7) == []
    pid = promote(engine, run_id=7, out_dir=tmp_path, setting=setting, previous=setting,
                  evidence={})
    mark_applied(engine, run_id=7, seq=1, step=10, error=None)
    with pytest.raises(OSError):
        end(engine, promotion_id=pid, out_dir=blocked, action="rollback",
            reason="slowdown")
    (row,) = list_promotions(engine, run_id=7)
    assert row.state == "applied" and row.reason is None


@pytest.fixture(params=["sqlite", "postgres"])
def any_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db.sqlite'}"
    return str(request.getfixturevalue("fresh_postgres_url"))


def test_migration_0006_adds_what_a_promotion_rests_on_and_rows_without_a_message(
        any_url: str, tmp_path: Path) -> None:
    """Rows from before 0006 keep their numbers with nothing recorded; after it a row may
    carry no message; the downgrade drops only those (the old schema cannot hold them)."""
    import json
    from datetime import UTC, datetime

    from sqlalchemy import inspect, text

    from traind.daemon.db.migrate import downgrade
    from traind.daemon.db.promotions import Stamp, record_unsent

    upgrade(any_url, "0005")
    engine = make_engine(any_url)
    try:
        setting = {"precision": "bf16", "compression": {"method": "none"}}
        with engine.begin() as conn:  # a row as 0005's schema holds it
            conn.execute(text(
                "INSERT INTO promotions (run_id, seq, state, setting, previous, evidence, "
                "created_at) VALUES (7, 1, 'kept', :s, :s, '{}', :t)"),
                {"s": json.dumps(setting), "t": datetime.now(UTC)})
        upgrade(any_url)
        (row,) = list_promotions(engine, run_id=7)
        assert (row.seq, row.state, row.config_hash, row.versions) == (1, "kept", None, None)
        stamp = Stamp("a" * 64, {"traind": "t", "torch": "2", "device": "cpu"}, "a" * 64,
                      {"traind": "t", "torch": "2", "device": "cpu"})
        unsent = record_unsent(engine, run_id=7, state="unchanged", setting=setting,
                               previous=setting, evidence={}, autotune_id=None,
                               reason="nothing beat the baseline", stamp=stamp)
        got = {p.id: p for p in list_promotions(engine, run_id=7)}
        assert got[unsent].seq is None and got[unsent].versions == stamp.versions
        assert got[unsent].evidence_config_hash == "a" * 64
        # the numbering goes on past a row without a number
        assert promote(engine, run_id=7, out_dir=tmp_path, setting=setting,
                       previous=setting, evidence={}, stamp=stamp) > unsent
        assert read_control(tmp_path / FILENAME).seq == 2  # type: ignore[union-attr]
        downgrade(any_url, "0005")
        cols = {c["name"] for c in inspect(engine).get_columns("promotions")}
        assert "config_hash" not in cols and "evidence_versions" not in cols
        with engine.connect() as conn:  # the message-less row is gone, the others stay
            assert list(conn.scalars(text("SELECT seq FROM promotions ORDER BY id"))) == [1, 2]
        upgrade(any_url)
    finally:
        engine.dispose()


VERSIONS = {"traind": "0.test", "torch": "2.13.0", "device": "cpu"}


def _config(**job: object) -> dict[str, object]:
    from traind.trainer.config import TrainConfig

    cfg = TrainConfig().model_dump(mode="json")
    cfg["job"].update(job)
    return cfg


def test_the_promote_path_stamps_refuses_and_says_when_nothing_beat_the_baseline(
        tmp_path: Path) -> None:
    from traind.daemon.config import ConfigError
    from traind.daemon.promotions import hand_over
    from traind.daemon.provenance import Provenance

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    config = _config()
    target = Provenance.of("run 7", config, VERSIONS)
    bf16 = {"precision": "bf16", "compression": {"method": "none"}}
    same = Provenance.of("experiment 3", _config(steps=40, name="exp"), VERSIONS)

    def go(setting: dict[str, object], evidence_from: list[Provenance],
           baseline: bool = False) -> int | None:
        return hand_over(engine, run_id=7, out_dir=tmp_path, config=config, setting=setting,
                         evidence={"rounds": [{}, {}]}, autotune_id=1, target=target,
                         evidence_from=evidence_from, baseline=baseline)

    # another rank count (and device) in the evidence: refused, naming the fields, nothing sent
    other = Provenance.of("experiment 4", _config(nproc_per_node=2),
                          {**VERSIONS, "device": "NVIDIA H200"})
    with pytest.raises(ConfigError) as err:
        go(bf16, [same, other])
    assert {loc for loc, _ in err.value.errors} == {("job", "nproc_per_node"),
                                                    ("versions", "device")}
    assert "2 in experiment 4, 1 in run 7" in str(err.value)
    assert not (tmp_path / FILENAME).exists()
    # nothing beat the baseline: recorded, not sent
    fp32 = {"precision": "fp32", "compression": {"method": "none"}}
    assert go(fp32, [same], baseline=True) is None
    assert not (tmp_path / FILENAME).exists()
    # the run already trains with the winner: recorded, not sent
    assert go(fp32, [same]) is None
    # a real promotion: sent, with what it rests on
    pid = go(bf16, [same])
    assert pid is not None and read_control(tmp_path / FILENAME).seq == 1  # type: ignore[union-attr]
    rows = list_promotions(engine, run_id=7)
    assert [(p.state, p.seq) for p in rows] == [
        ("pending", 1), ("unchanged", None), ("unchanged", None), ("refused", None)]
    sent, already, nothing, refused = rows
    assert "nothing beat the baseline (fp32 \u00b7 none) in 2 rounds" in (nothing.reason or "")
    assert "run 7 already trains with" in (already.reason or "")
    assert "job.nproc_per_node" in (refused.reason or "")
    # the same basis whatever the steps or the name: one hash for evidence and target
    assert sent.config_hash == sent.evidence_config_hash == target.config_hash
    assert sent.versions == sent.evidence_versions == VERSIONS
    assert refused.evidence_versions == {**VERSIONS, "device": "NVIDIA H200, cpu"}


def _eval(step: int, loss: float) -> object:
    from traind.contracts.events import EvalEvent

    return EvalEvent(rank=0, step=step, val_loss=loss, batches=1)


def test_the_guard_splits_reports_at_the_step_the_change_took_effect(tmp_path: Path) -> None:
    """Reports and validation losses that arrive while the applied row is read back belong
    after the change, not in its reference; a NaN among them rolls back."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    setting = {"precision": "bf16", "compression": {"method": "none"}}
    promote(engine, run_id=7, out_dir=tmp_path, setting=setting, previous=setting, evidence={})
    guard = Guard(engine, lambda _run: tmp_path)

    async def main() -> None:
        guard.observe(7, LifecycleEvent(rank=0, phase="started", step=0, detail={}))
        for step in range(1, 6):
            guard.observe(7, _report(step, 100.0 + step))
        guard.observe(7, _eval(5, 3.0))  # type: ignore[arg-type]
        guard.observe(7, LifecycleEvent(rank=0, phase="promoted", step=5, detail={"seq": 1}))
        guard.observe(7, _report(6, 106.0))  # before the row is read back
        guard.observe(7, _eval(6, 3.1))  # type: ignore[arg-type]
        await asyncio.gather(*guard._tasks)
        w = guard._watch[7]
        assert [s.step for s in w.before] == [1, 2, 3, 4, 5] and [s.step for s in w.after] == [6]
        assert [e.step for e in w.evals_before] == [5] and [e.step for e in w.evals_after] == [6]
        guard.observe(7, _eval(7, float("nan")))  # type: ignore[arg-type]
        await asyncio.gather(*guard._tasks)

    asyncio.run(main())
    (row,) = list_promotions(engine, run_id=7)
    assert row.state == "rolling_back" and "non-finite validation loss" in (row.reason or "")
