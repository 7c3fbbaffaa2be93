"""The node with real torchrun workers (no web server): runs recorded, failures explained."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING

import pytest

from traind.daemon.config import load_settings
from traind.daemon.db import crud
from traind.daemon.node import Node
from traind.trainer.threads import usable_cpus

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

TINY = ["job.steps=30", "job.eval_every=10", "job.eval_batches=1", "job.checkpoint_every=15",
        "job.threads=1", "job.batch_size=4", "model.seq_len=32", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "data.max_bytes=300000", "daemon.default_job=false"]


def _node(tmp_path: Path, *extra: str) -> Node:
    node = Node(load_settings(env={}, overrides=[*TINY, f"daemon.var_dir={tmp_path}", *extra]))
    node.migrate()
    return node


async def _run(node: Node, kill_after_step: int | None = None) -> int:
    rid = await node.submit(node.settings)
    if kill_after_step is not None:
        while node.supervisor.summaries[rid].step < kill_after_step:
            await asyncio.sleep(0.05)
        for pid in node.supervisor.worker_pids():
            import psutil
            for child in psutil.Process(pid).children(recursive=True):
                os.kill(child.pid, signal.SIGKILL)
    await asyncio.wait(node.supervisor.tasks | node.interleaved.tasks, timeout=120)
    node.flusher.flush()
    return rid


def test_completed_run_has_summary_and_events(tmp_path: Path):
    node = _node(tmp_path)
    rid = asyncio.run(_run(node))
    view = crud.get_run(node.engine, run_id=rid)
    assert view is not None and view.state == "completed", view
    assert view.exit_code == 0
    assert view.summary["step"] == 30 and view.summary["val_loss"] > 0
    assert view.summary["checkpoints"] >= 2
    # the CPUs and threads the ranks planned with, and the host gauges beside them
    assert (view.summary["threads"], view.summary["usable_cpus"]) == (1, usable_cpus())
    assert node.registry.get_sample_value("traind_host_usable_cpus") == usable_cpus()
    assert node.registry.get_sample_value("traind_host_oversubscribed") in (0.0, 1.0)
    kinds = {e["kind"] for e in crud.run_events(node.engine, run_id=rid)}
    assert {"started", "eval", "checkpoint", "finished"} <= kinds
    assert (tmp_path / "runs" / str(rid) / "config.json").exists()


def test_worker_that_fails_marks_the_run_failed_with_its_log(tmp_path: Path):
    node = _node(tmp_path, f'data.paths=["{tmp_path}/missing-corpus"]')
    rid = asyncio.run(_run(node))
    view = crud.get_run(node.engine, run_id=rid)
    assert view is not None and view.state == "failed"
    assert view.exit_code not in (0, None)
    assert view.error is not None and "data.paths" in view.error, view.error


def test_worker_killed_mid_run_is_noticed(tmp_path: Path):
    node = _node(tmp_path, "job.steps=100000")
    rid = asyncio.run(_run(node, kill_after_step=3))
    view = crud.get_run(node.engine, run_id=rid)
    assert view is not None and view.state == "failed", view
    assert view.error and "last log lines" in view.error


def test_interleaved_run_gets_a_verdict_in_its_summary(tmp_path: Path):
    from traind.daemon.experiments.stats import KINDS

    node = _node(tmp_path, "job.steps=40",
                 'interleave.arms=[{"name": "fp32", "precision": "fp32"}, '
                 '{"name": "bf16", "precision": "bf16"}]',
                 "interleave.block_steps=5", "interleave.warmup_steps=1")
    rid = asyncio.run(_run(node))
    view = crud.get_run(node.engine, run_id=rid)
    assert view is not None and view.state == "completed", view
    verdict = view.summary["ab"]["bf16"]
    assert verdict["kind"] in KINDS and verdict["pairs"] == 4, verdict
    assert verdict["reason"]
    arms = [e["data"]["arm"] for e in crud.run_events(node.engine, run_id=rid, kind="arm")]
    assert arms == ["fp32", "bf16", "bf16", "fp32", "fp32", "bf16", "bf16", "fp32"]


def _spec(**kw):
    from traind.daemon.service import ExperimentSpec

    base = dict(name="ab", steps=40, block_steps=5, warmup_steps=1,
                arms=({"name": "fp32", "precision": "fp32"},
                      {"name": "bf16", "precision": "bf16"}))
    return ExperimentSpec(**{**base, **kw})


def test_an_experiment_runs_as_an_interleaved_job_and_keeps_its_verdict(tmp_path: Path):
    from traind.daemon.db import queue
    from traind.daemon.experiments.stats import KINDS

    node = _node(tmp_path)

    async def main():
        exp = await node.service.submit_experiment(_spec())
        assert exp.state == "running" and exp.run_id is not None
        await asyncio.wait(node.supervisor.tasks | node.interleaved.tasks, timeout=120)
        return exp.id

    exp_id = asyncio.run(main())
    found = node.service.experiment(exp_id)
    assert found is not None and found.state == "done", found
    assert found.arms == ("fp32", "bf16")
    assert found.verdict["bf16"]["kind"] in KINDS
    trials = queue.list_trials(node.engine, experiment_id=exp_id)
    assert [t.state for t in trials] == ["done", "done"]
    assert all(t.result and t.result["blocks"] == 4 for t in trials)
    assert [e.id for e in node.service.experiments()] == [exp_id]
    # What the verdict rests on, read back from the run's stored blocks: 4 each, in ABBA
    # order, the budget's 4 pairs done, and the interval named with its test.
    ev = node.service.experiment_evidence(exp_id)
    assert ev is not None
    assert [m.arm for m in ev.measurements] == ["fp32", "bf16", "bf16", "fp32"] * 2
    assert [m.n for m in ev.means] == [4, 4] and all(m.tokens_per_second for m in ev.means)
    assert (ev.progress.done, ev.progress.of, ev.progress.unit) == (4, 4, "pairs")
    assert found.verdict["bf16"]["interval"] == "95% always-valid confidence sequence"


def test_a_bad_experiment_is_refused_with_the_field_and_nothing_recorded(tmp_path: Path):
    from traind.daemon.config import ConfigError

    node = _node(tmp_path)
    bad = _spec(arms=({"name": "A"}, {"name": "B", "compression": {"method": "int9"}}),
                overrides={"model.n_layerz": 2})
    with pytest.raises(ConfigError) as exc:
        asyncio.run(node.service.submit_experiment(bad))
    assert "model.n_layerz" in str(exc.value) or "interleave.arms.1" in str(exc.value)
    assert node.service.experiments() == [] and crud.list_runs(node.engine) == []


def test_cancel_stops_the_job(tmp_path: Path):
    node = _node(tmp_path)

    async def main():
        exp = await node.service.submit_experiment(_spec(steps=100_000))
        while node.supervisor.summaries[exp.run_id].step < 3:
            await asyncio.sleep(0.05)
        assert await node.service.cancel_experiment(exp.id)
        # Cancelled at once, its job asked to stop and not waited for (a web request
        # returns before the job has checkpointed and gone).
        assert node.service.experiment(exp.id).state == "cancelled"
        assert exp.run_id in node.supervisor.jobs
        await asyncio.wait(node.supervisor.tasks | node.interleaved.tasks, timeout=120)
        assert not await node.service.cancel_experiment(exp.id)  # already ended
        return exp

    exp = asyncio.run(main())
    found = node.service.experiment(exp.id)
    assert found is not None and found.state == "cancelled"
    run = crud.get_run(node.engine, run_id=exp.run_id)
    assert run is not None and run.state == "stopped"
    # The run's own A/B line says cancelled too, not "1.26x so far".
    assert {v["kind"] for v in run.summary["ab"].values()} == {"cancelled"}, run.summary["ab"]
    assert "the experiment was cancelled before bf16 was decided" in (
        run.summary["ab"]["bf16"]["reason"])
    # It left at a step boundary with a checkpoint of that step.
    kinds = crud.run_events(node.engine, run_id=exp.run_id, kinds=("checkpoint", "finished"))
    assert [e["kind"] for e in kinds][-1] == "finished" and kinds[-1]["data"]["stopped"]
    assert any(e["kind"] == "checkpoint" and e["step"] == kinds[-1]["step"] for e in kinds)


def test_the_token_file_is_private_and_stable(tmp_path: Path):
    import stat

    node = _node(tmp_path)
    mode = stat.S_IMODE((tmp_path / "token").stat().st_mode)
    assert mode == 0o600 and node.token_created
    again = _node(tmp_path)
    assert again.token == node.token and not again.token_created
    assert node.service.check_token(node.token) and not node.service.check_token("nope")
    assert not node.service.check_token(None)


def test_a_compression_arm_on_one_rank_is_refused_before_a_launch(tmp_path: Path):
    from traind.daemon.config import ConfigError

    node = _node(tmp_path)
    bad = _spec(arms=({"name": "A"}, {"name": "B", "compression": {"method": "int8"}}))
    with pytest.raises(ConfigError, match=r"interleave.arms.1.compression.method: 'int8'"):
        asyncio.run(node.service.submit_experiment(bad))
    assert node.service.experiments() == [] and crud.list_runs(node.engine) == []


def test_adaptive_precision_reaches_the_hub_and_the_metrics(tmp_path: Path):
    """A real adaptive job: each window's SNR once (not per report) and each switch go to the
    hub for the run page; every group's SNR and mode to the metrics."""
    node = _node(tmp_path, "precision.mode=adaptive", "precision.snr_window=5",
                 "precision.snr_low=0.01", "precision.snr_high=0.1", "precision.min_dwell=0")
    rid = asyncio.run(_run(node))
    snap = node.hub.snapshot()
    assert snap["run"] == rid
    assert [w["step"] for w in snap["snr"]] == [5, 10, 15, 20, 25, 30]
    assert all(w["groups"] == ["block.0", "head"] for w in snap["snr"])
    assert all(isinstance(v, float) and v > 0 for w in snap["snr"] for v in w["snr"])
    assert {(s["step"], s["group"], s["after"]) for s in snap["precision"]} == {
        (5, "block.0", "bf16"), (5, "head", "bf16")}
    assert snap["snr"][0]["modes"] == ["bf16", "bf16"]
    samples = {(s.name, s.labels.get("group"), s.labels.get("mode")): s.value
               for s in node.service.samples("traind_precision_")}
    assert samples[("traind_precision_gradient_snr", "head", None)] == snap["snr"][-1]["snr"][1]
    assert samples[("traind_precision_mode", "block.0", "bf16")] == 1.0


def test_a_two_rank_run_fills_the_comm_and_hardware_history(tmp_path: Path):
    """Real gloo ranks: the router feeds every rank's comm and probe events to the history the
    Communication page charts; the hardware sampler reads the real host (no GPU here)."""
    node = _node(tmp_path, "job.nproc_per_node=2", "telemetry.probe_every=10",
                 "telemetry.probe_sizes=[4096,65536]", "telemetry.probe_repeats=2")

    async def main() -> int:
        rid = await _run(node)
        node.hardware.record(await asyncio.to_thread(node.hardware.sample))
        return rid

    rid = asyncio.run(main())
    comm = node.service.comm_history()
    assert comm["run"] == rid
    ar = next(e for e in comm["latency"] if e["op"] == "all_reduce")
    assert sum(ar["calls"]) > 0 and all(p is None or p > 0 for p in ar["p50"])
    assert [p["size_bytes"] for p in comm["probe"]] == [4096, 65536]
    assert len(comm["probe"][0]["step"]) >= 2 and min(comm["probe"][0]["bus_bandwidth"]) > 0
    hw = node.service.hardware_history()
    assert len(hw["time"]) == 1 and 0 <= hw["cpu"][0] <= 1 and hw["memory_used"][0] > 0
    if hw["gpu_devices"] == 0:  # this machine: NVML absent, and said why
        assert hw["gpus"] == [] and hw["gpu_absent"]
