from traind.contracts.events import EvalEvent, LifecycleEvent, StepEvent
from traind.daemon.runs.summary import RunSummary


def step(n: int, loss: float, *, rank: int = 0, steps: int = 1) -> StepEvent:
    return StepEvent(rank=rank, step=n, loss=loss, lr=1e-3, grad_norm=1.0, tokens=64,
                     step_seconds=0.01, data_seconds=0, forward_seconds=0,
                     backward_seconds=0, optimizer_seconds=0, steps=steps)


def test_summary_folds_events_from_all_ranks():
    s = RunSummary()
    s.observe(LifecycleEvent(rank=0, phase="started", step=0,
                             detail={"world_size": 2, "params": 10, "total_steps": 9}))
    s.observe(step(2, 3.0, steps=2))
    s.observe(step(2, 3.1, rank=1, steps=2))
    s.observe(step(4, 2.0, steps=2))
    s.observe(EvalEvent(rank=0, step=4, val_loss=2.2, batches=1))
    s.observe(LifecycleEvent(rank=0, phase="checkpoint", step=4, detail={"path": "p"}))
    d = s.as_dict()
    assert (d["step"], d["loss"], d["first_loss"], d["val_loss"]) == (4, 2.0, 3.0, 2.2)
    assert d["tokens"] == 64 * 2 * 3
    assert d["tokens_per_second"] == 64 * 2 / 0.01  # both ranks, from rank 0's timing
    assert (d["world_size"], d["params"], d["total_steps"]) == (2, 10, 9)
    assert (d["checkpoints"], d["last_checkpoint"]) == (1, "p")
    assert "dirty" not in d
