"""A killed daemon's lost events, stored from its ranks' spools by the next one (issue 40.1):
what is replayed and what is not, decided from the database's tail. The real kill is in
tests/e2e/test_preemption.py; these pin each rule of the decision."""

from __future__ import annotations

from traind.contracts.events import CommEvent, EvalEvent, Event, LifecycleEvent, StepEvent
from traind.daemon.ingest.series import COMM, RANK_STEPS, STEPS
from traind.daemon.runs.recovery import LEAD, Stored, marks, replay
from traind.daemon.runs.summary import RunSummary


def _step(rank: int, step: int) -> StepEvent:
    return StepEvent(rank=rank, step=step, loss=1.0 / step, lr=1e-3, grad_norm=1.0, tokens=64,
                     step_seconds=0.1, data_seconds=0.0, forward_seconds=0.03,
                     backward_seconds=0.05, optimizer_seconds=0.01, time=1e9 + step)


def _comm(rank: int, step: int) -> CommEvent:
    return CommEvent(rank=rank, step=step, method="none", steps=5, buckets=5, raw_bytes=100,
                     sent_bytes=100, rel_error=0.0, hook_seconds=0.0, allreduce_seconds=0.1,
                     world_size=2, time=1e9 + step + 0.5)


def _spool() -> list[Event]:
    """Two ranks, steps 1..10, comm reports at 5 and 10, a checkpoint at 8, an eval at 10."""
    events: list[Event] = []
    for step in range(1, 11):
        for rank in (0, 1):
            events.append(_step(rank, step))
            if step % 5 == 0:
                events.append(_comm(rank, step))
        if step == 8:
            events.append(LifecycleEvent(rank=0, phase="checkpoint", step=8,
                                         detail={"path": "/r/step_00000008.pt"}))
    events.append(EvalEvent(rank=0, step=10, val_loss=2.0, batches=2))
    return events


def _summary() -> RunSummary:
    return RunSummary(world_size=2, ranks_per_node=2, step=6, tokens=6 * 2 * 64)


def test_only_what_the_database_lacks_is_replayed_and_nothing_past_the_checkpoint() -> None:
    # Stored: the lead's steps to 6, rank 0's per-rank steps to 6 and rank 1's to 5, rank
    # 0's comm report at 5 (rank 1's never arrived). The ranks saved at step 8.
    stored = Stored({(STEPS, LEAD): 6, (RANK_STEPS, 0): 6, (RANK_STEPS, 1): 5, (COMM, 0): 5},
                    set())
    summary = _summary()
    rows = replay(_spool(), stored, summary, until=8,
                  checkpoints=[(8, "/r/step_00000008.pt")])
    by_kind: dict[str, list[dict]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    (steps,) = by_kind["steps"]
    assert steps["data"]["step"] == [7, 8]
    (ranks,) = by_kind["rank_steps"]
    assert list(zip(ranks["data"]["step"], ranks["data"]["rank"], strict=True)) == [
        (6, 1), (7, 0), (7, 1), (8, 0), (8, 1)]
    (comm,) = by_kind["comm"]
    assert list(zip(comm["data"]["reports"]["step"], comm["data"]["reports"]["rank"],
                    strict=True)) == [(5, 1)]
    # The checkpoint's own event, once (not also a "recovered" one); no eval past step 8.
    (ckpt,) = by_kind["checkpoint"]
    assert ckpt["step"] == 8 and "recovered" not in ckpt["data"]
    assert "eval" not in by_kind
    # Folded as the live ingest would: the tokens of each step new to the database, once
    # (rank 0's 7 and 8, rank 1's 6 to 8).
    assert summary.step == 8 and summary.tokens == 6 * 2 * 64 + 5 * 64
    assert summary.last_checkpoint == "/r/step_00000008.pt" and summary.checkpoints == 1


def test_a_replay_of_what_is_all_stored_adds_nothing() -> None:
    stored = Stored({(STEPS, LEAD): 10, (RANK_STEPS, 0): 10, (RANK_STEPS, 1): 10,
                     (COMM, 0): 10, (COMM, 1): 10},
                    {("checkpoint", 8, 0), ("eval", 10, 0)})
    assert replay(_spool(), stored, _summary(), until=None,
                  checkpoints=[(8, "/r/step_00000008.pt")]) == []


def test_a_checkpoint_on_disk_without_an_event_gets_one_marked_recovered() -> None:
    # A rank killed between writing its checkpoint and spooling the event.
    summary = _summary()
    rows = replay([], Stored({}, {("checkpoint", 4, 0)}), summary, until=12,
                  checkpoints=[(4, "/r/step_00000004.pt"), (12, "/r/step_00000012.pt")])
    assert rows == [{"kind": "checkpoint", "step": 12, "rank": 0,
                     "data": {"path": "/r/step_00000012.pt", "recovered": True}}]
    assert summary.last_checkpoint == "/r/step_00000012.pt"


def test_the_marks_are_the_newest_stored_step_of_each_kind_and_rank() -> None:
    chunks = {
        STEPS: [{"step": [9, 10]}, {"step": [7, 8]}],
        RANK_STEPS: [{"step": [10, 10], "rank": [0, 1]}, {"step": [9, 8], "rank": [0, 2]}],
        COMM: [{"reports": {"step": [10], "rank": [1]}}],
    }
    assert marks(chunks) == {(STEPS, LEAD): 10, (RANK_STEPS, 0): 10, (RANK_STEPS, 1): 10,
                             (RANK_STEPS, 2): 8, (COMM, 1): 10}
