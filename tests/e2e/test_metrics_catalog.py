"""A CPU-only node as an infra engineer scrapes it: 2 gloo ranks, a 6-layer model."""

from __future__ import annotations

import subprocess
import time
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_daemon, stop_daemon
from traind.metrics.catalog import BY_NAME, CATALOG, MetricSpec

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.conftest import DaemonProc

pytestmark = pytest.mark.slow
# Families of prometheus_client's standard collectors (the daemon process, Python's GC).
STANDARD = ("process_", "python_")
RANKS = ("0", "1")
# Families the catalog labels by rank that this job has no per-rank figure for, and why. Every
# other one (GPU-only families aside) must show each rank: a family a rank stops reporting, or
# a new per-rank family nobody exports, fails here.
NOT_EVERY_RANK = {
    "traind_checkpoints": "the lead rank's, and only once a checkpoint is written",
    "traind_checkpoint_duration_seconds": "the lead rank's, once a checkpoint is written",
    "traind_precision_mode": "the lead rank reports the policy",
    "traind_device_peak_flops": "a GPU's datasheet peak: none on the CPU",
    "traind_train_nonfinite_steps": "only once a loss is NaN or infinite",
    "traind_numerics_actions": "only once numerics.policy acts",
    "traind_numerics_rolled_back_steps": "only once numerics.policy rolls back",
    "traind_precision_switches": "precision.mode = adaptive only",
    "traind_precision_gradient_snr": "precision.mode = adaptive only",
    "traind_arm_blocks": "interleaved experiments only",
    "traind_arm_tokens_per_second": "interleaved experiments only",
    "traind_arm_block_loss": "interleaved experiments only",
    "traind_data_filtered_bytes": "prepared shards' filter report only (data.shards)",
    "traind_data_filtered_tokens": "prepared shards' filter report only (data.shards)",
    **{m.name: "parallel.pp > 1 only" for m in CATALOG if m.name.startswith("traind_pipeline_")},
}
PER_RANK = tuple(m for m in CATALOG if "rank" in m.labels and not m.gpu_only
                 and m.name not in NOT_EVERY_RANK)
# Label values this job gives each rank, by family (what the node fixture configures: DDP
# over dp, no compression, three probe sizes).
RANK_VALUES: dict[str, dict[str, set[str]]] = {
    "traind_step_phase_duration_seconds": {"phase": {"data", "forward", "backward",
                                                     "optimizer"}},
    "traind_ddp_seconds": {"phase": {"forward_compute", "backward_compute", "backward_comm",
                                     "backward_overlap"}, "mesh_dim": {"dp"}},
    "traind_comm_probe_latency_seconds": {"size_bytes": {"4096", "262144", "4194304"},
                                          "op": {"all_reduce"}, "mesh_dim": {"dp"}},
    "traind_comm_probe_bus_bandwidth_bytes_per_second": {
        "size_bytes": {"4096", "262144", "4194304"}, "op": {"all_reduce"}, "mesh_dim": {"dp"}},
    **{m.name: {"method": {"none"}, "mesh_dim": {"dp"}} for m in CATALOG
       if m.labels == ("run", "rank", "mesh_dim", "method")},
    **{m.name: {"op": {"all_reduce"}, "mesh_dim": {"dp"}} for m in CATALOG
       if m.name.startswith("traind_comm_collective_")},
}
LAYERS = {"embed", "head", *(f"block.{i}" for i in range(6))}


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


def _missing_per_rank(text: str) -> list[str]:
    """What the catalog's per-rank families lack in a scrape: ``family{rank=..}`` for a rank
    without it, ``family{rank=..,label=value}`` for a label value a rank lacks, and a
    histogram's buckets other than the catalog's."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    out: list[str] = []
    for spec in PER_RANK:
        samples = [s for s in fams[spec.name].samples] if spec.name in fams else []
        for rank in RANKS:
            mine = [s.labels for s in samples if s.labels.get("rank") == rank
                    and s.labels.get("run") == "1"]
            if not mine:
                out.append(f"{spec.name}{{rank={rank}}}")
                continue
            for label, values in RANK_VALUES.get(spec.name, {}).items():
                out += [f"{spec.name}{{rank={rank},{label}={v}}}"
                        for v in sorted(values - {lab.get(label) for lab in mine})]
            if spec.kind == "histogram":
                out += _buckets(spec, [lab for lab in mine if "le" in lab], rank)
    return out


def _buckets(spec: MetricSpec, labels: list[dict[str, str]], rank: str) -> list[str]:
    want = {float(b) for b in spec.buckets} | {float("inf")}
    series: dict[tuple[tuple[str, str], ...], set[float]] = {}
    for lab in labels:
        key = tuple(sorted((k, v) for k, v in lab.items() if k != "le"))
        series.setdefault(key, set()).add(float(lab["le"]))
    return [f"{spec.name}{{rank={rank}}} buckets {sorted(got)} not the catalog's {sorted(want)}"
            for got in series.values() if got != want] if spec.buckets else []


def test_every_per_rank_family_on_every_rank_all_declared_in_the_catalog(node: Any) -> None:
    assert set(NOT_EVERY_RANK) <= set(BY_NAME), "a family NOT_EVERY_RANK names is not declared"
    # Waited for (a condition, not a time): the probe and the first evaluation come at step
    # 20, the per-layer norms every 5 steps.
    deadline, missing, text = time.monotonic() + 180, ["nothing scraped"], ""
    while time.monotonic() < deadline:
        text = node.get("/metrics").text
        if not (missing := _missing_per_rank(text)):
            break
        time.sleep(0.5)
    assert not missing, f"per-rank series missing after 180 s: {missing}\n" + \
        node.log.read_text()[-2000:]
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    print(f"{len(series)} series on a 2-rank CPU node, {len(PER_RANK)} families on each rank")
    families = {f.name for f in text_string_to_metric_families(text)}
    undeclared = {f for f in families if not f.startswith(STANDARD)
                  and f not in BY_NAME and f.removesuffix("_info") not in BY_NAME}
    assert not undeclared, f"exported but not in metrics/catalog.py: {sorted(undeclared)}"
    # The run's own families (no rank label): every layer of the 6-block model, the goodput
    # ledger (issue 17) from the lead rank's first report.
    samples = [(s.name, s.labels) for f in text_string_to_metric_families(text)
               for s in f.samples]
    for family in ("traind_layer_grad_norm", "traind_layer_weight_norm",
                   "traind_layer_update_ratio"):
        layers = {lab["layer"] for n, lab in samples if n == family and lab.get("run") == "1"}
        assert layers == LAYERS, (family, sorted(layers))
    for name, labels in [("traind_goodput_ratio", {}),
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
