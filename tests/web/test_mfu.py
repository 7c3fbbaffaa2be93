"""MFU has one definition (metrics/throughput.mfu): the job's model FLOP/s over the sum of its
devices' peaks. A fake 8-GPU node's events go through the daemon's own folds (the Prometheus
families of metrics/training.py and the run summary of daemon/runs/summary.py, what the
database stores); a real Prometheus evaluates the recording rule's PromQL over the scrapes of
those families, and the run page shows the summary's figure: all three must be one number.

The scrapes are backfilled with their timestamps (``promtool tsdb create-blocks-from
openmetrics``) and the rule's expression is queried at a fixed time, so nothing depends on
when Prometheus happens to scrape."""

from __future__ import annotations

import html
import re
import subprocess
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import running_prometheus
from traind.contracts.events import LifecycleEvent, StepEvent
from traind.daemon.runs.summary import RunSummary
from traind.metrics import grafana
from traind.metrics.throughput import mfu
from traind.metrics.training import TrainingMetrics
from traind.trainer.device import peak_flops
from traind.web.views import fmt_percent

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow

RUN, RANKS = 1, 8
GPU = "NVIDIA H100 80GB HBM3"  # what NVML and CUDA call an H100 SXM
FLOPS_PER_TOKEN = 6 * 7e9  # a 7B model's training FLOPs per token (6N)
TOKENS = 4096  # per rank and step: batch 2 x seq 2048
STEP = 1.0  # seconds a step takes on every rank
STEPS, SCRAPE = 180, 5  # three minutes of steps, scraped every 5 s
INSTANCE = "gpu-node-7:8800"
FAMILIES = ("traind_train_tokens", "traind_model_flops_per_token", "traind_device_peak_flops")


def _started(rank: int, t0: float, peak: float | None) -> LifecycleEvent:
    return LifecycleEvent(rank=rank, phase="started", step=0, time=t0, detail={
        "world_size": RANKS, "flops_per_token": FLOPS_PER_TOKEN, "params": int(7e9),
        "device": f"cuda:{rank}", "device_name": GPU, "peak_flops": peak, "total_steps": STEPS})


def _step(rank: int, step: int, t0: float) -> StepEvent:
    return StepEvent(rank=rank, step=step, loss=2.0, lr=3e-4, grad_norm=1.0, tokens=TOKENS,
                     step_seconds=STEP, data_seconds=0.0, forward_seconds=0.3,
                     backward_seconds=0.6, optimizer_seconds=0.1, time=t0 + step * STEP)


def _node(t0: float, peaks: list[float | None]) -> tuple[TrainingMetrics, CollectorRegistry,
                                                          RunSummary, list[str]]:
    """Eight ranks' started and step events through the daemon's folds; the families MFU
    reads, as OpenMetrics lines of a scrape every ``SCRAPE`` seconds (with timestamps)."""
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry, retention_seconds=1e9)
    summary = RunSummary(ranks_per_node=RANKS)
    series: dict[str, dict[str, list[str]]] = {f: {} for f in FAMILIES}
    for rank in range(RANKS):
        for sink in (metrics.observe, lambda _, e: summary.observe(e)):
            sink(RUN, _started(rank, t0, peaks[rank]))
    for step in range(1, STEPS + 1):
        for rank in range(RANKS):
            event = _step(rank, step, t0)
            metrics.observe(RUN, event)
            summary.observe(event)
        if step % SCRAPE == 0:  # a scrape at the end of this step
            at = t0 + step * STEP
            for family in registry.collect():
                if family.name not in FAMILIES:
                    continue
                for s in family.samples:
                    if s.name.endswith("_created"):
                        continue
                    labels = {**s.labels, "instance": INSTANCE, "job": "traind"}
                    key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in
                                                  sorted(labels.items())) + "}"
                    series[family.name].setdefault(key, []).append(f"{key} {s.value!r} {at}")
    lines = []
    for family, by_series in series.items():
        lines.append(f"# TYPE {family} {'counter' if family.endswith('tokens') else 'gauge'}")
        for samples in by_series.values():
            lines += samples
    return metrics, registry, summary, [*lines, "# EOF"]


def _query_at(prometheus: str, promtool: str, lines: list[str], expr: str, at: float,
              tmp_path: Path) -> list[dict[str, Any]]:
    """``expr`` evaluated at ``at`` by a real Prometheus over the backfilled scrapes."""
    om, tsdb = tmp_path / "scrapes.om", tmp_path / "tsdb"
    om.write_text("\n".join(lines) + "\n")
    done = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet",
                           str(om), str(tsdb)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1m\n")
    with running_prometheus(prometheus, config, tsdb, tmp_path / "prometheus.log") as url:
        r = httpx.get(f"{url}/api/v1/query", params={"query": expr, "time": at}, timeout=30)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]  # type: ignore[no-any-return]


def _rule(name: str) -> str:
    (rule,) = [r for r in grafana.RULES if r.record == name]
    return rule.expr


def test_an_8_gpu_node_s_mfu_is_one_number_in_prometheus_the_summary_and_the_page(
        prometheus_bin: str, promtool_bin: str, tmp_path: Path, session_client: TestClient,
        service: Any) -> None:
    peak = peak_flops(GPU, "bf16")
    assert peak == 989e12  # the SXM part's dense bf16
    t0 = float(int(time.time()) - 3600)  # an hour ago: inside the TSDB's retention
    _, _, summary, lines = _node(t0, [peak] * RANKS)

    # What the job did: 8 ranks x 4,096 tokens a second, 42 GFLOP each, on 8 H100s.
    expected = RANKS * TOKENS / STEP * FLOPS_PER_TOKEN / (RANKS * peak)
    assert expected == pytest.approx(0.174, abs=5e-4)

    # The database's summary (what the runs table and the run page read).
    assert summary.tokens_per_second == pytest.approx(RANKS * TOKENS / STEP, rel=1e-9)
    assert summary.mfu == pytest.approx(expected, rel=1e-9)
    assert summary.as_dict()["mfu"] == summary.mfu

    # The recording rule's PromQL on a real Prometheus, over the scrapes of the families.
    result = _query_at(prometheus_bin, promtool_bin, lines, _rule("traind:mfu:ratio_rate1m"),
                       t0 + STEPS * STEP, tmp_path)
    assert [r["metric"] for r in result] == [{"instance": INSTANCE, "run": str(RUN)}], result
    from_rule = float(result[0]["value"][1])
    # One device's peak in the denominator would read 8 times this (139%).
    assert from_rule == pytest.approx(expected, rel=1e-6), from_rule / expected

    # The run page shows the same number.
    service.run_views = [replace(r, summary={**r.summary, **summary.as_dict()})
                         if r.id == 1 else r for r in service.run_views]
    page = html.unescape(session_client.get("/runs/1").text)
    shown = re.search(r'<dd data-field="mfu">([^<]*)</dd>', page)
    assert shown is not None, page
    assert shown.group(1) == fmt_percent(from_rule) == "17%"


def test_a_rank_whose_peak_is_unknown_leaves_mfu_unset_not_overstated() -> None:
    """A CPU rank, or a GPU not in the table: the sum of the peaks is not known, so neither
    is MFU (dividing by the known ones alone would flatter it)."""
    peak = peak_flops(GPU, "bf16")
    _, _, summary, _ = _node(1_000.0, [peak] * (RANKS - 1) + [None])
    assert summary.tokens_per_second > 0 and summary.mfu is None
    _, _, cpu, _ = _node(1_000.0, [None] * RANKS)
    assert cpu.mfu is None
    assert mfu(cpu.tokens_per_second, FLOPS_PER_TOKEN, cpu.job_peaks()) is None


def test_each_rank_exports_its_own_device_peak() -> None:
    """The rule sums ``traind_device_peak_flops`` over the ranks: one series per rank."""
    peak = peak_flops(GPU, "bf16")
    _, registry, _, _ = _node(1_000.0, [peak] * RANKS)
    got = {s.labels["rank"]: s.value for f in registry.collect()
           if f.name == "traind_device_peak_flops" for s in f.samples}
    assert got == {str(r): peak for r in range(RANKS)}
