"""A CPU-only node as an infra engineer scrapes it: 2 gloo ranks, a 6-layer model."""

from __future__ import annotations

import subprocess
import time
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_daemon, stop_daemon
from traind.metrics.catalog import BY_NAME

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.conftest import DaemonProc

pytestmark = pytest.mark.slow
# Families of prometheus_client's standard collectors (the daemon process, Python's GC).
STANDARD = ("process_", "python_")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    # Stopped when the module ends: its two ranks would otherwise train behind later tests.
    d = start_daemon(tmp_path_factory.mktemp("node"), steps=100_000, sets=(
        "job.nproc_per_node=2", "model.n_layers=6", "telemetry.probe_every=20",
        "telemetry.layer_every=5", "telemetry.probe_repeats=2",
        'telemetry.probe_sizes=[4096,262144,4194304]'))
    yield d
    stop_daemon(d)


def _scrape_when(node: Any, ready: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = node.get("/metrics").text
        if ready in text:  # a sample, not just the family's HELP line
            return text
        time.sleep(0.5)
    raise AssertionError(f"{ready} never appeared:\n{node.log.read_text()[-3000:]}")


def test_at_least_300_series_all_declared_in_the_catalog(node: Any) -> None:
    text = _scrape_when(node, "traind_comm_probe_latency_seconds{")
    time.sleep(2)
    text = node.get("/metrics").text
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    print(f"{len(series)} series on a 2-rank CPU node")
    assert len(series) >= 300, len(series)
    families = {f.name for f in text_string_to_metric_families(text)}
    undeclared = {f for f in families if not f.startswith(STANDARD)
                  and f not in BY_NAME and f.removesuffix("_info") not in BY_NAME}
    assert not undeclared, f"exported but not in metrics/catalog.py: {sorted(undeclared)}"
    # Every rank reports; comm, probe and per-layer families are there.
    samples = [(s.name, s.labels) for f in text_string_to_metric_families(text)
               for s in f.samples]
    for name, labels in [("traind_train_loss", {"rank": "1"}),
                         ("traind_comm_sent_bytes_total",
                          {"method": "none", "rank": "1", "mesh_dim": "dp"}),
                         ("traind_layer_grad_norm", {"layer": "block.5"}),
                         ("traind_comm_probe_latency_seconds",
                          {"size_bytes": "4194304", "mesh_dim": "dp"}),
                         ("traind_comm_collective_latency_seconds_bucket",
                          {"op": "all_reduce", "rank": "1", "le": "+Inf", "mesh_dim": "dp"}),
                         ("traind_comm_collective_calls_total",
                          {"op": "all_reduce", "mesh_dim": "dp"}),
                         ("traind_ddp_overlap_ratio", {"rank": "0"}),
                         ("traind_data_cache_misses_total", {"tier": "memory", "rank": "1"}),
                         ("traind_data_prefetch_depth", {"rank": "0"}),
                         # goodput (issue 17): the lead rank's ledger, from the first report
                         ("traind_goodput_ratio", {}),
                         ("traind_effective_training_time_ratio", {}),
                         ("traind_badput_seconds_total", {"kind": "startup"}),
                         ("traind_node_goodput_ratio", {}), ("traind_node_idle_seconds", {})]:
        assert any(n == name and labels.items() <= lab.items() for n, lab in samples), name


def test_series_move(node: Any) -> None:
    """Counters and per-step gauges change between scrapes: they are live, not constants."""
    _scrape_when(node, "traind_train_tokens_total{")
    def values() -> dict[str, float]:
        out = {}
        for fam in text_string_to_metric_families(node.get("/metrics").text):
            for s in fam.samples:
                out[s.name + str(sorted(s.labels.items()))] = s.value
        return out
    before = values()
    time.sleep(3)
    after = values()
    moving = [k for k in ("traind_train_tokens_total", "traind_train_steps_total",
                          "traind_comm_gradient_bytes_total", "traind_host_cpu_seconds_total",
                          "traind_process_cpu_seconds_total")
              if any(n.startswith(k) and after.get(n) != v for n, v in before.items())]
    assert len(moving) == 5, moving


def test_promtool_accepts_a_live_scrape(node: Any, promtool_bin: str) -> None:
    promtool = promtool_bin
    text = _scrape_when(node, "traind_comm_gradient_bytes_total{")
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
