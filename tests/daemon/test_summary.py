import dataclasses
from typing import Any

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


def test_started_event_gives_threads_and_cpus():
    s = RunSummary(ranks_per_node=2)
    s.observe(LifecycleEvent(rank=0, phase="started", step=0,
                             detail={"threads": 1, "local_ranks": 2, "usable_cpus": 2}))
    d = s.as_dict()
    assert (d["threads"], d["usable_cpus"], d["ranks_per_node"]) == (1, 2, 2)


def _supervisor(summaries: dict[int, RunSummary], jobs: set[int]) -> Any:
    # check_host reads only the summaries and which runs have a job: no engine, no launcher
    from traind.daemon.runs.supervisor import Supervisor

    sup: Any = Supervisor(settings=None, engine=None, var_dir=None, node_name="n",
                          tracer=None, metrics=None, hub=None, on_event=lambda *a: None,
                          flush=lambda: None)
    sup.summaries = summaries
    sup.jobs = dict.fromkeys(jobs)
    return sup


def test_host_checks_count_only_runs_that_train():
    training, waiting, ended = RunSummary(), RunSummary(), RunSummary()
    training.observe(step(1, 3.0))
    ended.observe(step(1, 3.0))
    ended.observe(LifecycleEvent(rank=0, phase="finished", step=1))
    sup = _supervisor({1: training, 2: waiting, 3: ended, 4: RunSummary()}, jobs={1, 2, 3})
    reads = []

    def runnable() -> int:
        reads.append(1)
        return 5

    sup.check_host(runnable, lambda: 2)
    sup.check_host(lambda: 2, lambda: 2)
    assert (training.host_checks, training.host_oversubscribed) == (2, 1)
    assert all(s.host_checks == 0 for s in (waiting, ended))
    assert training.as_dict()["host_oversubscribed"] == 1
    sup.summaries = {2: waiting}
    sup.check_host(runnable, lambda: 2)
    assert len(reads) == 1  # no run trains: /proc is not read


def test_a_host_without_proc_stat_counts_no_check():
    s = RunSummary()
    s.observe(step(1, 3.0))
    _supervisor({1: s}, jobs={1}).check_host(lambda: None, lambda: 2)
    assert s.host_checks == 0


def test_the_summary_keeps_the_runs_goodput_live_and_final():
    """Issue 17: the lead rank's ledger, folded from the launch (metrics/goodput.py), is in the
    summary the DB stores, while the run trains and with its end; other ranks' do not count."""
    s = RunSummary(ranks_per_node=2)
    assert s.observe(step(1, 3.0)).goodput is None and s.goodput is None  # not launched
    s.launched(100.0)
    s.observe(LifecycleEvent(rank=0, phase="started", step=0, detail={}))
    ledger = {"started": 101.0, "setup": 2.0, "restore": 0.0, "checkpoint": 0.0, "eval": 0.0,
              "numerics": 0.0, "data": 0.5, "train": 6.5, "time": 110.0}
    other = dataclasses.replace(step(2, 3.1, rank=1), clock={**ledger, "train": 99.0})
    assert s.observe(other).goodput is None  # rank 1 is not this node's lead
    live = s.observe(dataclasses.replace(step(2, 3.0), clock=ledger)).goodput
    assert live is not None and live.wall == 10.0 and live.productive == 6.5
    assert s.as_dict()["goodput"]["ratio"] == 0.65
    final = s.ended(112.0)
    assert final is not None and final.badput["shutdown"] == 2.0
    d = s.as_dict()["goodput"]
    assert d["wall"] == 12.0 and d["badput"]["startup"] == 3.0 and "_goodput" not in s.as_dict()
    assert d["productive"] + sum(d["badput"].values()) == d["wall"]


def test_the_lead_ranks_data_report_is_kept_whole() -> None:
    from traind.contracts.events import DataEvent

    s = RunSummary(ranks_per_node=2)

    def data(rank: int, tokens: int) -> DataEvent:
        return DataEvent(rank=rank, step=5, cache_hits={}, cache_misses={},
                         cache_write_errors=0, filtered={"near_duplicate": 2},
                         documents_kept=9, bytes_kept=0, batches_served=5,
                         prefetch_capacity=2, prefetch_depth_mean=1.0, prefetch_depth_last=2,
                         prefetch_wait_seconds=0.5, tokens_kept=tokens,
                         filtered_bytes={"near_duplicate": 100},
                         filtered_tokens={"near_duplicate": 30}, tier_hits={"host": 4},
                         tier_misses={"host": 1}, tier_wait_seconds={"host": 0.5})

    s.observe(data(1, 999))  # not the lead rank
    assert s.data is None
    s.observe(data(0, 1000))
    assert s.data == {"tokens": 1000, "documents": 9,
                      "filtered": {"near_duplicate": {"documents": 2, "bytes": 100,
                                                      "tokens": 30}},
                      "tiers": {"host": {"hits": 4, "misses": 1, "wait_seconds": 0.5}},
                      "wait_seconds": 0.5, "batches": 5}
    assert s.as_dict()["data"] == s.data


def test_a_resumed_run_names_the_checkpoint_it_trains_on_from() -> None:
    """Issue 40: after a kill the summary named step_50 while step_92 was on disk: a resumed
    life's summary starts afresh, and only its next checkpoint named one."""
    s = RunSummary(total_steps=100)
    s.observe(LifecycleEvent(rank=0, phase="started", step=92, detail={"world_size": 1}))
    assert s.last_checkpoint is None
    s.observe(LifecycleEvent(rank=0, phase="resumed", step=92,
                             detail={"path": "/r/step_00000092.pt"}))
    assert s.last_checkpoint == "/r/step_00000092.pt" and s.checkpoints == 0
