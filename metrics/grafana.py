"""Grafana dashboards and Prometheus recording rules, as code.

Every panel is first a plain :class:`PanelSpec` in :data:`PANELS` (title, PromQL, unit, kind);
the grafana-foundation-sdk builders only render that list. So the test that runs each panel's
PromQL against a real Prometheus checks exactly what Grafana will ask, and the files under
``docker/`` are a pure function of this module (a test regenerates them and compares).

Panels whose series do not exist on every node say so in ``needs``: ``gpu`` (NVML families),
``per_layer`` and ``probe`` (telemetry families that can be switched off), ``pipeline``
(only a job with ``parallel.pp`` > 1 has stages), ``adaptive``
(precision switching only happens with ``precision.mode = "adaptive"``) and ``future`` (the
experiment scheduler's families, not exported yet). The live test checks those panels only
when their family is in the scrape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from grafana_foundation_sdk.builders import common as b_common
from grafana_foundation_sdk.builders import dashboard as b_dashboard
from grafana_foundation_sdk.builders import heatmap as b_heatmap
from grafana_foundation_sdk.builders import prometheus as b_prometheus
from grafana_foundation_sdk.builders import stat as b_stat
from grafana_foundation_sdk.builders import statetimeline as b_statetimeline
from grafana_foundation_sdk.builders import timeseries as b_timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as m_dashboard
from grafana_foundation_sdk.models import heatmap as m_heatmap
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from traind.metrics.training import MODES

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

    from grafana_foundation_sdk.cog.builder import Builder

DATASOURCE_UID = "traind-prometheus"
# Panels point at the `datasource` variable, whose default is the provisioned uid: on a Grafana
# that already has its own Prometheus the user picks it from the drop-down, no JSON editing.
DS = m_dashboard.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"  # Grafana widens it to >= 4 scrape intervals; tests use 30s

Kind = Literal["timeseries", "heatmap", "le_heatmap", "stat", "state"]
Need = Literal["gpu", "per_layer", "probe", "adaptive", "pipeline", "future"]

# Label matchers shared by the panels (without braces). Host and process families carry only
# the scrape target's `instance`; training families add run and rank.
NODE = 'instance=~"$instance"'
RUN = f'{NODE}, run=~"$run"'
TRAIN = f'{RUN}, rank=~"$rank"'
COMM = f'{TRAIN}, method=~"$method"'
GPU = f'{NODE}, gpu=~"$gpu"'
GPU_SM = f'{GPU}, clock="sm"'
BUSY = f'{NODE}, mode=~"user|system|iowait"'  # host CPU modes drawn (idle is the rest)


def m(name: str, matchers: str, window: str | None = None) -> str:
    """``name{matchers}``, or the range selector ``name{matchers}[window]``."""
    sel = f"{name}{{{matchers}}}"
    return f"{sel}[{window}]" if window else sel


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True, slots=True)
class PanelSpec:
    dashboard: str  # key of DASHBOARDS
    title: str
    exprs: tuple[Query, ...]
    kind: Kind = "timeseries"
    unit: str = "short"
    description: str = ""
    needs: Need | None = None
    width: int = 12  # of Grafana's 24 grid columns
    stack: bool = False
    mappings: tuple[tuple[int, str, str], ...] = ()  # (value, text, colour) for state panels

    @property
    def gpu_only(self) -> bool:
        return self.needs == "gpu"

    @property
    def needs_per_layer(self) -> bool:
        return self.needs == "per_layer"

    @property
    def future(self) -> bool:
        return self.needs == "future"


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    label: str
    query: str  # Grafana's label_values(selector, label) form


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    key: str
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]  # names in VARIABLES, in drop-down order


@dataclass(frozen=True, slots=True)
class Rule:
    record: str
    expr: str
    why: str


@dataclass(frozen=True, slots=True)
class Alert:
    """A ready alerting rule: fires once ``expr`` has held for ``for_``."""

    alert: str
    expr: str
    for_: str
    severity: str
    summary: str  # Prometheus templates ({{ $labels.run }}, {{ $value }}) allowed


VARIABLES = {v.name: v for v in (
    Variable("instance", "node", "label_values(traind_build_info, instance)"),
    Variable("run", "run", f"label_values({m('traind_train_step', NODE)}, run)"),
    Variable("rank", "rank", f"label_values({m('traind_train_step', RUN)}, rank)"),
    Variable("method", "compression",
             f"label_values({m('traind_comm_sent_bytes_total', RUN)}, method)"),
    Variable("gpu", "GPU", f"label_values({m('traind_gpu_utilization_ratio', NODE)}, gpu)"),
)}

DASHBOARDS = {d.key: d for d in (
    DashboardSpec("node", "traind-node", "traind / Node overview",
                  "Loss, throughput, step time and the host it runs on.",
                  ("instance", "run", "rank")),
    DashboardSpec("gpu", "traind-gpu", "traind / GPU and interconnect",
                  "Per-GPU utilisation, memory, power, thermals, clocks, PCIe and NVLink.",
                  ("instance", "gpu")),
    DashboardSpec("comm", "traind-comm", "traind / Communication",
                  "Gradient traffic, compression and collective wait per rank.",
                  ("instance", "run", "rank", "method")),
    DashboardSpec("training", "traind-training", "traind / Training internals",
                  "Norms, learning rate, loss scale, precision per group, per-layer heatmaps.",
                  ("instance", "run", "rank")),
    DashboardSpec("experiments", "traind-experiments", "traind / Experiments",
                  "A/B experiments and trials (placeholders until the scheduler exports).",
                  ("instance",)),
)}

# Rates are computed once in Prometheus rather than per browser refresh. The [1m] window keeps
# at least 4 samples at scrape intervals up to 15 s (a rate needs 2; 4 rides out a lost scrape).
RULES: tuple[Rule, ...] = (
    Rule("traind:train_tokens:rate1m", "rate(traind_train_tokens_total[1m])",
         "Tokens per second per rank; sum by run for the job's throughput."),
    Rule("traind:train_steps:rate1m", "rate(traind_train_steps_total[1m])",
         "Optimizer steps per second per rank."),
    # metrics/throughput.mfu's definition: the node's share of the job's tokens/s (every
    # rank's tokens counter) x FLOPs per token over the sum of the node's ranks' device
    # peaks. Divided by one device's peak it would read world-size times too high.
    Rule("traind:mfu:ratio_rate1m",
         "sum by (instance, run) (rate(traind_train_tokens_total[1m])) "
         "* on (instance, run) max by (instance, run) (traind_model_flops_per_token) "
         "/ on (instance, run) sum by (instance, run) (traind_device_peak_flops)",
         "Model FLOPs utilisation per job on each node: achieved model FLOP/s over the sum "
         "of its ranks' datasheet peaks (GPU jobs only; metrics/throughput.mfu)."),
    *(Rule(f"traind:step_duration_seconds:p{q}_rate1m",
           f"histogram_quantile(0.{q}, rate(traind_step_duration_seconds_bucket[1m]))",
           f"Step time {q}th percentile over the last minute, per rank.")
      for q in (50, 95, 99)),
    *(Rule(f"traind:step_phase_duration_seconds:p{q}_rate1m",
           f"histogram_quantile(0.{q}, rate(traind_step_phase_duration_seconds_bucket[1m]))",
           f"Phase time {q}th percentile, per rank and phase.") for q in (50, 95)),
    Rule("traind:step_phase_duration_seconds:mean_rate1m",
         "rate(traind_step_phase_duration_seconds_sum[1m])"
         " / rate(traind_step_phase_duration_seconds_count[1m])",
         "Mean phase time: these add up to the step, so they stack (quantiles do not)."),
    *(Rule(f"traind:comm_{name}:rate1m", f"rate(traind_comm_{name}_total[1m])", why)
      for name, why in (
          ("gradient_bytes", "Gradient bytes per second before compression."),
          ("sent_bytes", "Bytes per second on the wire after compression, modelled: ring "
                         "formulas on the bytes handed to each collective."),
          ("hook_seconds", "Seconds per second compressing: the hook's share of wall time."),
          ("allreduce_seconds", "Seconds per second in collectives: the wait's share."),
      )),
)


def _precision_code() -> str:
    """One number per group: the index of its current mode in MODES (0 = fp32).

    traind_precision_mode is an enum as one 0/1 series per mode, which a state timeline would
    draw as four rows per group; weighting each by its index folds them into one row.
    """
    by = "sum by (instance, run, rank, group)"
    terms = []
    for i, mode in enumerate(MODES):
        sel = m("traind_precision_mode", TRAIN + f', mode="{mode}"')
        terms.append(f"{i} * {by} ({sel})")
    return " + ".join(terms)


_MODE_COLOURS = ("blue", "green", "orange", "purple")
RL = "run {{run}} rank {{rank}}"  # the legend most training panels share

PANELS: tuple[PanelSpec, ...] = (
    # --- node overview -------------------------------------------------------------------
    PanelSpec("node", "Tokens / s (selected runs)", (Query(
        f"sum({m('traind:train_tokens:rate1m', TRAIN)})"),), "stat", "short", width=6),
    PanelSpec("node", "Step time p50", (Query(
        f"max({m('traind:step_duration_seconds:p50_rate1m', TRAIN)})"),), "stat", "s",
        "Slowest rank's median: in data parallel the slowest rank sets the pace.", width=6),
    PanelSpec("node", "Node goodput", (Query(m("traind_node_goodput_ratio", NODE),
              "{{instance}}"),), "stat", "percentunit", width=6,
              description="Productive training time of the node's runs over its wall time "
              "since the daemon started (runs at once each count)."),
    PanelSpec("node", "Node idle", (Query(m("traind_node_idle_seconds", NODE),
              "{{instance}}"),), "stat", "s", width=6,
              description="Time since the daemon started with no run's workers alive."),
    PanelSpec("node", "Runs running", (Query(m("traind_runs_running", NODE)),), "stat",
              width=6),
    PanelSpec("node", "Host collector healthy", (Query(
        m("traind_host_collector_success", NODE)),), "stat",
        description="0 means a host read failed; the scrape still succeeds.", width=6,
        mappings=((0, "failing", "red"), (1, "ok", "green"))),
    PanelSpec("node", "Loss", (
        Query(m("traind_train_loss", TRAIN), f"train {RL}"),
        Query(m("traind_validation_loss", TRAIN), f"validation {RL}"),
    ), unit="none", description="Cross-entropy in nats per token."),
    PanelSpec("node", "Tokens / s", (
        Query(f"sum by (instance, run) ({m('traind:train_tokens:rate1m', TRAIN)})",
              "run {{run}} total"),
        Query(m("traind:train_tokens:rate1m", TRAIN), RL),
    ), description="rate() of the tokens counter over 1 min, so every step counts, also "
                   "those between telemetry reports."),
    PanelSpec("node", "Step time p50 / p95", (
        Query(m("traind:step_duration_seconds:p50_rate1m", TRAIN), f"p50 {RL}"),
        Query(m("traind:step_duration_seconds:p95_rate1m", TRAIN), f"p95 {RL}"),
    ), unit="s"),
    PanelSpec("node", "Step time by phase (mean)", (Query(
        m("traind:step_phase_duration_seconds:mean_rate1m", TRAIN),
        "{{phase}} rank {{rank}}"),), unit="s", stack=True,
        description="Stacked means add up to the step; a growing 'data' band is an input "
                    "bottleneck."),
    PanelSpec("node", "Step time distribution", (Query(
        f"sum by (le) (rate({m('traind_step_duration_seconds_bucket', TRAIN, RATE)}))",
        "{{le}}"),), "le_heatmap", "s"),
    PanelSpec("node", "Data: prefetch queue depth and wait", (
        Query(m("traind_data_prefetch_depth_mean", TRAIN), "mean depth rank {{rank}}"),
        Query(f"rate({m('traind_data_wait_seconds_total', TRAIN, RATE)})",
              "wait share rank {{rank}}"),), unit="none",
        description="Depth near 0 with a rising wait share: the input pipeline, not the "
                    "model, sets the pace."),
    PanelSpec("node", "Data: cache hits by tier", (Query(
        f"sum by (run, tier) ({m('traind_data_cache_hits_total', TRAIN)})"
        f" / (sum by (run, tier) ({m('traind_data_cache_hits_total', TRAIN)})"
        f" + sum by (run, tier) ({m('traind_data_cache_misses_total', TRAIN)}))",
        "{{tier}} run {{run}}"),), unit="percentunit"),
    PanelSpec("node", "Data: documents filtered by reason", (Query(
        f"sum by (run, reason) ({m('traind_data_filtered_documents_total', TRAIN)})",
        "{{reason}}"),), "stat", width=6),
    PanelSpec("node", "Host CPU busy", (
        Query(m("traind_host_cpu_usage_ratio", NODE), "busy"),
        Query(f"sum by (instance, mode) (rate({m('traind_host_cpu_seconds_total', BUSY, RATE)}))"
              f" / on (instance) group_left {m('traind_host_cpus', NODE)}", "{{mode}}"),
    ), unit="percentunit"),
    PanelSpec("node", "Host memory", (
        Query(m("traind_host_memory_used_bytes", NODE), "used"),
        Query(m("traind_host_memory_available_bytes", NODE), "available"),
        Query(m("traind_host_memory_total_bytes", NODE), "total"),
    ), unit="bytes"),
    PanelSpec("node", "Worker RSS", (
        Query(m("traind_process_resident_memory_bytes", f'{NODE}, role="worker"'),
              "worker {{pid}}"),
        Query(m("traind_process_resident_memory_bytes", f'{NODE}, role="daemon"'),
              "daemon {{pid}}"),
    ), unit="bytes"),
    PanelSpec("node", "Process CPU", (Query(
        f"rate({m('traind_process_cpu_seconds_total', NODE, RATE)})", "{{role}} {{pid}}"),),
        unit="percentunit", description="1.0 = one core busy."),
    PanelSpec("node", "Host load", (Query(m("traind_host_load", NODE), "{{window}}"),)),
    PanelSpec("node", "Events from workers / s", (Query(
        f"sum by (kind) (rate({m('traind_events_received_total', NODE, RATE)}))",
        "{{kind}}"),), unit="ops"),
    PanelSpec("node", "Events dropped", (
        Query(m("traind_worker_events_dropped", TRAIN), f"worker queue {RL}"),
        Query(m("traind_live_messages_dropped", NODE), "live websocket"),
    ), description="Cumulative; any rise means telemetry is being shed, never the step "
                   "slowed."),
    # --- GPU and interconnect ------------------------------------------------------------
    PanelSpec("gpu", "GPU utilisation", (
        Query(m("traind_gpu_utilization_ratio", GPU), "gpu {{gpu}} kernel"),
        Query(m("traind_gpu_sm_active_ratio", GPU), "gpu {{gpu}} SM active"),
    ), unit="percentunit", needs="gpu",
        description="'kernel' is NVML's any-kernel-running share, 100% even for one busy SM; "
                    "'SM active' (Hopper GPM) is the share of SMs doing work."),
    PanelSpec("gpu", "GPU memory", (
        Query(m("traind_gpu_memory_used_bytes", GPU), "gpu {{gpu}} used"),
        Query(m("traind_gpu_memory_total_bytes", GPU), "gpu {{gpu}} total"),
    ), unit="bytes", needs="gpu"),
    PanelSpec("gpu", "Power", (
        Query(m("traind_gpu_power_watts", GPU), "gpu {{gpu}} sampled"),
        Query(f"rate({m('traind_gpu_energy_joules_total', GPU, RATE)})", "gpu {{gpu}} mean"),
        Query(m("traind_gpu_power_limit_watts", GPU), "gpu {{gpu}} limit"),
    ), unit="watt", needs="gpu",
        description="The energy counter's rate is the true mean; the sample can miss peaks."),
    PanelSpec("gpu", "Temperature", (Query(m("traind_gpu_temperature_celsius", GPU),
              "gpu {{gpu}} {{sensor}}"),), unit="celsius", needs="gpu",
              description="sensor 'memory' is the HBM stacks."),
    PanelSpec("gpu", "SM clock vs max", (
        Query(m("traind_gpu_clock_hertz", GPU_SM), "gpu {{gpu}}"),
        Query(m("traind_gpu_clock_max_hertz", GPU_SM), "gpu {{gpu}} max"),
    ), unit="hertz", needs="gpu"),
    PanelSpec("gpu", "Throttle reasons", (Query(
        f"{m('traind_gpu_throttle_reason', GPU)} > 0", "gpu {{gpu}} {{reason}}"),), "state",
        needs="gpu", mappings=((1, "active", "red"),),
        description="Only active reasons are drawn: a clear panel means full clocks."),
    PanelSpec("gpu", "PCIe throughput", (Query(
        f"rate({m('traind_gpu_pcie_bytes_total', GPU, RATE)})", "gpu {{gpu}} {{direction}}"),),
        unit="Bps", needs="gpu"),
    *(PanelSpec("gpu", f"NVLink {d.upper()} per link", (Query(
        f"sum by (gpu, link) (rate({m('traind_gpu_nvlink_bytes_total', f'{GPU}, {dm}', RATE)}))",
        "gpu {{gpu}} link {{link}}"),), "heatmap", "Bps", needs="gpu",
        description="One row per link: a dark row among bright ones is a down or slow link.")
      for d, dm in (("tx", 'direction="tx"'), ("rx", 'direction="rx"'))),
    PanelSpec("gpu", "NVLink total per GPU", (Query(
        f"sum by (gpu, direction) (rate({m('traind_gpu_nvlink_bytes_total', GPU, RATE)}))",
        "gpu {{gpu}} {{direction}}"),), unit="Bps", needs="gpu",
        description="Per-GPU sums work with per-link export off too (same family name)."),
    PanelSpec("gpu", "NVLink links up", (Query(
        f"sum by (gpu) ({m('traind_gpu_nvlink_active_links', GPU)})", "gpu {{gpu}}"),),
        needs="gpu"),
    PanelSpec("gpu", "GPU collector healthy", (Query(
        m("traind_gpu_collector_success", NODE)),), "stat", needs="gpu", width=6,
        mappings=((0, "failing", "red"), (1, "ok", "green"))),
    # --- communication -------------------------------------------------------------------
    PanelSpec("comm", "Gradient bytes / s: raw vs sent", (
        Query(f"sum by (run, method) ({m('traind:comm_gradient_bytes:rate1m', COMM)})",
              "{{method}} raw"),
        Query(f"sum by (run, method) ({m('traind:comm_sent_bytes:rate1m', COMM)})",
              "{{method}} sent (modelled wire)"),
    ), unit="Bps", description="Raw: gradient bytes handed to the hook (measured). Sent: "
        "the wire bytes ring formulas give for the bytes handed to each collective."),
    PanelSpec("comm", "Compression ratio", (Query(m("traind_comm_compression_ratio", COMM),
              f"{{{{method}}}} {RL}"),), unit="none",
              description="The fp32 all-reduce's modelled wire bytes over the modelled wire "
              "bytes sent: 1 = uncompressed."),
    PanelSpec("comm", "Compression error", (Query(
        m("traind_comm_compression_error_ratio", COMM), f"{{{{method}}}} {RL}"),),
        unit="percentunit", description="||g_hat - g|| / ||g|| of the last report."),
    PanelSpec("comm", "Share of wall time: hook vs collective", (
        Query(m("traind:comm_hook_seconds:rate1m", COMM), f"hook {RL}"),
        Query(m("traind:comm_allreduce_seconds:rate1m", COMM), f"all-reduce {RL}"),
    ), unit="percentunit"),
    PanelSpec("comm", "Collective wait per rank", (Query(
        f"sum by (run, rank) ({m('traind:comm_allreduce_seconds:rate1m', COMM)})", RL),),
        unit="percentunit",
        description="A straggler shows as the rank that waits least: the others wait for "
                    "it inside the all-reduce."),
    PanelSpec("comm", "Wait spread across ranks", (Query(
        f"max by (run) ({m('traind:comm_allreduce_seconds:rate1m', COMM)})"
        f" - min by (run) ({m('traind:comm_allreduce_seconds:rate1m', COMM)})",
        "run {{run}}"),), unit="percentunit",
        description="max - min of the per-rank wait share; near 0 when ranks are even."),
    PanelSpec("comm", "Gradient buckets per step", (Query(
        f"sum by (run, rank) (rate({m('traind_comm_buckets_total', COMM, RATE)}))"
        f" / sum by (run, rank) (rate({m('traind_train_steps_total', TRAIN, RATE)}))", RL),)),
    PanelSpec("comm", "Collective latency p95 by op and size", (Query(
        "histogram_quantile(0.95, sum by (le, mesh_dim, op, size) (rate("
        f"{m('traind_comm_collective_latency_seconds_bucket', TRAIN, RATE)})))",
        "{{mesh_dim}} {{op}} {{size}}"),), unit="s",
        description="Training-path collectives, binned on each rank: a size bucket whose "
                    "latency grows is a link or a straggler, not the model."),
    PanelSpec("comm", "Collectives / s by op and size", (Query(
        "sum by (run, mesh_dim, op, size) "
        f"(rate({m('traind_comm_collective_calls_total', TRAIN, RATE)}))",
        "{{mesh_dim}} {{op}} {{size}}"),), unit="ops"),
    # --- the device mesh: dp, tp and pp side by side ---------------------------------------
    PanelSpec("comm", "Collective bytes / s by mesh dimension", (Query(
        "sum by (run, mesh_dim) "
        f"(rate({m('traind_comm_collective_bytes_total', TRAIN, RATE)}))",
        "{{mesh_dim}} run {{run}}"),), unit="Bps",
        description="Every rank's collectives by the mesh dimension whose group ran them: "
                    "dp the gradient hook's, tp DTensor's (pipeline traffic: the stage "
                    "panels)."),
    PanelSpec("comm", "Collective time share by mesh dimension", (Query(
        "sum by (run, rank, mesh_dim) "
        f"(rate({m('traind_comm_allreduce_seconds_total', TRAIN, RATE)}))",
        "{{mesh_dim}} rank {{rank}}"),), unit="percentunit",
        description="Share of wall time some collective of the dimension was in flight."),
    PanelSpec("comm", "Pipeline bubble by stage", (
        Query(m("traind_pipeline_bubble_ratio", TRAIN), "stage {{stage}} rank {{rank}}"),
        Query(f"max by (run, stage) ({m('traind_pipeline_bubble_theoretical_ratio', TRAIN)})",
              "theory stage {{stage}}"),
    ), unit="percentunit", needs="pipeline",
        description="Idle share of each stage's step, measured, beside (p - 1) / (m + p - 1)."),
    PanelSpec("comm", "Pipeline activation bytes per step by stage", (Query(
        m("traind_pipeline_p2p_bytes", f'{TRAIN}, op="send"'),
        "stage {{stage}} {{direction}} rank {{rank}}"),), unit="bytes", needs="pipeline",
        description="What each stage sends on per step: activations forward, their "
                    "gradients backward (mesh dimension pp)."),
    PanelSpec("comm", "Pipeline P2P wait per step by stage", (Query(
        f"sum by (run, rank, stage, direction) ({m('traind_pipeline_p2p_wait_seconds', TRAIN)})",
        "stage {{stage}} {{direction}} rank {{rank}}"),), unit="s", needs="pipeline",
        description="Host time each stage blocked on its sends and receives: a receive's "
                    "wait holds its neighbour's compute as well as the transfer."),
    PanelSpec("comm", "Collective bus bandwidth", (Query(
        m("traind_comm_collective_bus_bandwidth_bytes_per_second", TRAIN),
        "{{op}} {{size}} rank {{rank}}"),), unit="Bps",
        description="nccl-tests factors: comparable across world sizes and with the probe."),
    PanelSpec("comm", "DDP compute / communication overlap", (Query(
        m("traind_ddp_overlap_ratio", TRAIN), RL),), unit="percentunit",
        description="DDP's own figure: the share of backward communication hidden under "
                    "backward compute (1 = fully hidden)."),
    PanelSpec("comm", "DDP iteration timing", (Query(
        m("traind_ddp_seconds", TRAIN), "{{phase}} rank {{rank}}"),), unit="s"),
    PanelSpec("comm", "Probe latency by size", (Query(
        m("traind_comm_probe_latency_seconds", TRAIN), "{{op}} {{size_bytes}} B rank {{rank}}"),
    ), unit="s", needs="probe"),
    PanelSpec("comm", "Probe bus bandwidth by size", (Query(
        m("traind_comm_probe_bus_bandwidth_bytes_per_second", TRAIN),
        "{{op}} {{size_bytes}} B rank {{rank}}"),), unit="Bps", needs="probe"),
    # --- training internals --------------------------------------------------------------
    PanelSpec("training", "Gradient norm", (Query(m("traind_grad_norm", TRAIN), RL),),
              unit="none", description="Global L2 norm before clipping."),
    PanelSpec("training", "Learning rate", (Query(m("traind_learning_rate", TRAIN), RL),),
              unit="none"),
    PanelSpec("training", "Loss scale", (Query(m("traind_loss_scale", TRAIN), RL),),
              unit="none", description="fp16 GradScaler scale; 1 without a scaler."),
    PanelSpec("training", "Skipped steps", (Query(
        f"increase({m('traind_train_skipped_steps_total', TRAIN, RATE)})", RL),),
        description="inf/NaN gradients in the window (fp16 overflow)."),
    PanelSpec("training", "Precision mode per group", (Query(_precision_code(),
              "{{group}} rank {{rank}}"),), "state", width=24,
              mappings=tuple((i, mode, _MODE_COLOURS[i % len(_MODE_COLOURS)])
                             for i, mode in enumerate(MODES))),
    PanelSpec("training", "Precision switches", (Query(
        f"increase({m('traind_precision_switches_total', TRAIN, RATE)})",
        "{{group}} to {{mode}} rank {{rank}}"),), needs="adaptive"),
    PanelSpec("training", "Gradient SNR per group", (Query(
        m("traind_precision_gradient_snr", TRAIN), "{{group}} rank {{rank}}"),),
        unit="none", needs="adaptive",
        description="mean²/variance of each group's gradient norm over the last window: "
                    "above precision.snr_high the group drops to the low precision, below "
                    "snr_low it returns to fp32."),
    PanelSpec("training", "Model FLOP/s (achieved)", (Query(
        f"sum by (run) ({m('traind:train_tokens:rate1m', TRAIN)})"
        f" * on (run) max by (run) ({m('traind_model_flops_per_token', RUN)})",
        "run {{run}}"),), unit="flops",
        description="Tokens/s x FLOPs per token: the numerator of MFU."),
    PanelSpec("training", "MFU", (Query(
        m("traind:mfu:ratio_rate1m", RUN), "run {{run}}"),), unit="percentunit",
        needs="gpu", description="Model FLOP/s over the sum of the ranks' datasheet peaks "
        "(metrics/throughput.mfu); none where a device's peak is unknown (the CPU)."),
    PanelSpec("training", "Goodput and ETTR", (
        Query(m("traind_goodput_ratio", RUN), "goodput run {{run}}"),
        Query(m("traind_effective_training_time_ratio", RUN), "ETTR run {{run}}")),
        unit="percentunit", description="Goodput: productive training over the wall time "
        "since the launch; ETTR: the wall time less start-up, restarts, restores, lost "
        "progress and shutdown, over it (metrics/goodput.py)."),
    PanelSpec("training", "Badput by kind", (Query(
        f"sum by (kind) (increase({m('traind_badput_seconds_total', RUN, RATE)}))",
        "{{kind}}"),), unit="s", stack=True,
        description="Seconds of wall time that were not productive training, per kind, "
        "over each interval: startup, restart, data_wait, checkpoint_save, "
        "checkpoint_restore, evaluation, progress_lost, numerics_skip, profiling, shutdown."),
    PanelSpec("training", "Arrival skew at the gradient collectives", tuple(Query(
        f"histogram_quantile(0.{q}, sum by (run, le) "
        f"(rate({m('traind_rank_arrival_skew_seconds_bucket', RUN, RATE)})))",
        f"p{q} run {{{{run}}}}") for q in (50, 99)), unit="s",
        description="Per step, the last rank's arrival minus the first's (a shared clock, "
        "offsets estimated at start): a straggler makes every other rank wait this long."),
    PanelSpec("training", "Straggler rank", (
        Query(m("traind_straggler_rank", RUN), "rank, run {{run}} (-1: none)"),
        Query(m("traind_straggler_confidence_ratio", RUN), "confidence, run {{run}}")),
        description="The rank last at the collectives more often than chance allows "
        "(binomial test over the last 200 steps, p < 0.001), and 1 - p for the most-often-"
        "last rank (metrics/straggler.py)."),
    PanelSpec("training", "Parameters", (Query(m("traind_model_parameters", RUN),
              "run {{run}}"),), "stat", width=6),
    PanelSpec("training", "Checkpoint write time", (Query(
        m("traind_checkpoint_duration_seconds", TRAIN), RL),), "stat", "s", width=6),
    PanelSpec("training", "Per-layer gradient norm", (Query(
        m("traind_layer_grad_norm", RUN), "{{layer}}"),), "heatmap", needs="per_layer"),
    PanelSpec("training", "Per-layer update / weight ratio (log10)", (Query(
        f"log10({m('traind_layer_update_ratio', RUN)})", "{{layer}}"),), "heatmap",
        needs="per_layer", description="Around -3 is healthy for Adam; far above means "
                                       "the layer's learning rate is too high."),
    PanelSpec("training", "Per-layer weight norm", (Query(
        m("traind_layer_weight_norm", RUN), "{{layer}}"),), needs="per_layer", width=24),
    # --- experiments ---------------------------------------------------------------------
    PanelSpec("experiments", "Experiments by state", (Query(
        f"sum by (state) ({m('traind_experiments', NODE)})", "{{state}}"),)),
    PanelSpec("experiments", "Trials by state", (Query(
        f"sum by (state) ({m('traind_experiments_trials', NODE)})", "{{state}}"),)),
    PanelSpec("experiments", "Queue depth", (Query(
        m("traind_experiments_queue_depth", NODE), "queued"),)),
    PanelSpec("experiments", "Lease expiries / s", (Query(
        f"rate({m('traind_experiments_lease_expiries_total', NODE, RATE)})", "expired"),),
        unit="ops"),
)


# Alerts an operator can load as they are (docker/prometheus/rules.yml).
ALERTS: tuple[Alert, ...] = (
    Alert("TraindStraggler", "traind_straggler_rank >= 0", "5m", "warning",
          "Run {{ $labels.run }}: rank {{ $value }} arrives last at the gradient collectives "
          "more often than chance allows (metrics/straggler.py); the other ranks wait for "
          "it every step."),
    Alert("TraindLowGoodput", "traind_goodput_ratio < 0.5", "30m", "warning",
          "Run {{ $labels.run }}: under half of its wall time has been productive training "
          "(goodput {{ $value | humanizePercentage }}): see traind_badput_seconds_total by "
          "kind."),
)

# --- rendering --------------------------------------------------------------------------


def _target(q: Query, ref: str, fmt: PromQueryFormat) -> b_prometheus.Dataquery:
    return (b_prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto")
            .ref_id(ref).format(fmt).range().datasource(DS))


def _mappings(spec: PanelSpec) -> list[m_dashboard.ValueMapping]:
    if not spec.mappings:
        return []
    return [m_dashboard.ValueMap(options={
        str(v): m_dashboard.ValueMappingResult(text=text, color=colour, index=i)
        for i, (v, text, colour) in enumerate(spec.mappings)})]


def _panel(spec: PanelSpec, panel_id: int) -> Builder[m_dashboard.Panel]:
    """One spec as an SDK panel builder (the builders share the Panel interface)."""
    fmt = PromQueryFormat.HEATMAP if spec.kind == "le_heatmap" else PromQueryFormat.TIME_SERIES
    b: b_timeseries.Panel | b_heatmap.Panel | b_stat.Panel | b_statetimeline.Panel
    if spec.kind == "timeseries":
        b = (b_timeseries.Panel().line_width(1).fill_opacity(30 if spec.stack else 5)
             .legend(b_common.VizLegendOptions().show_legend(True)
                     .display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.BOTTOM).calcs(["lastNotNull", "max"]))
             .tooltip(b_common.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
        if spec.stack:
            b = b.stacking(b_common.StackingConfig().mode(common.StackingMode.NORMAL))
    elif spec.kind in ("heatmap", "le_heatmap"):
        # Both kinds arrive pre-bucketed (histogram `le` buckets, or one row per layer or
        # link), so Grafana must not re-bucket them.
        b = (b_heatmap.Panel().calculate(False).cell_gap(1).show_tooltip()
             .color(b_heatmap.HeatmapColorOptions().mode(m_heatmap.HeatmapColorMode.SCHEME)
                    .scheme("Spectral").scale(m_heatmap.HeatmapColorScale.EXPONENTIAL)
                    .exponent(0.5).steps(64))
             .y_axis(b_heatmap.YAxisConfig().unit(spec.unit if spec.kind == "le_heatmap"
                                                  else "short")))
        if spec.kind == "heatmap":
            b = b.cell_values(b_heatmap.CellValues().unit(spec.unit))
    elif spec.kind == "stat":
        b = (b_stat.Panel().graph_mode(common.BigValueGraphMode.AREA)
             .color_mode(common.BigValueColorMode.VALUE)
             .reduce_options(b_common.ReduceDataOptions().calcs(["lastNotNull"])))
    else:
        b = (b_statetimeline.Panel().show_value(common.VisibilityMode.NEVER)
             .merge_values(True).fill_opacity(80)
             .legend(b_common.VizLegendOptions().show_legend(True)
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM)))
    b = (b.id(panel_id).title(spec.title).datasource(DS).unit(spec.unit)
         .span(spec.width).height(4 if spec.kind == "stat" else 8))
    if spec.description:
        b = b.description(spec.description)
    if spec.mappings:
        b = b.mappings(_mappings(spec))
    for i, q in enumerate(spec.exprs):
        b = b.with_target(_target(q, chr(ord("A") + i), fmt))
    return b


def _variable(var: Variable) -> b_dashboard.QueryVariable:
    return (b_dashboard.QueryVariable(var.name).label(var.label).query(var.query)
            .datasource(DS).refresh(m_dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(m_dashboard.VariableSort.NUMERICAL_ASC).multi(True).include_all(True)
            # ".*" rather than Grafana's default list of every value: shorter queries, and
            # series that appear after the page loaded are still matched.
            .all_value(".*")
            .current(m_dashboard.VariableOption(selected=True, text="All", value="$__all")))


def dashboard(key: str) -> dict[str, object]:
    """The Grafana JSON model of one dashboard (what the provisioning folder holds)."""
    spec = DASHBOARDS[key]
    b = (b_dashboard.Dashboard(spec.title).uid(spec.uid).description(spec.description)
         .tags(["traind"]).editable().time("now-1h", "now").refresh("10s")
         .timezone("browser").tooltip(m_dashboard.DashboardCursorSync.CROSSHAIR)
         .with_variable(b_dashboard.DatasourceVariable("datasource").label("Prometheus")
                        .type("prometheus").current(m_dashboard.VariableOption(
                            selected=True, text=DATASOURCE_UID, value=DATASOURCE_UID)))
         .link(b_dashboard.DashboardLink("traind").type(m_dashboard.DashboardLinkType.DASHBOARDS)
               .tags(["traind"]).as_dropdown(True).include_vars(True).keep_time(True)))
    for name in spec.variables:
        b = b.with_variable(_variable(VARIABLES[name]))
    if "run" in spec.variables:
        # Checkpoints as vertical markers: a step-time spike at a marker is the write, not
        # the model.
        b = b.annotation(b_dashboard.AnnotationQuery().name("Checkpoints").datasource(DS)
                         .enable(True).icon_color("rgba(255, 176, 0, 0.6)")
                         .expr(f"changes({m('traind_checkpoints_total', TRAIN, '1m')}) > 0"))
    for panel_id, p in enumerate((p for p in PANELS if p.dashboard == key), start=1):
        b = b.with_panel(_panel(p, panel_id))
    return json.loads(json.dumps(b.build(), cls=JSONEncoder))


# --- files ------------------------------------------------------------------------------

HEADER = "# Generated by `traind grafana generate` from metrics/grafana.py: edit there.\n"
# Where the compose file mounts docker/grafana/dashboards inside the Grafana container.
CONTAINER_DASHBOARDS = "/var/lib/grafana/dashboards/traind"

DASHBOARD_PROVIDER = HEADER + f"""apiVersion: 1
providers:
  - name: traind
    folder: traind
    folderUid: traind
    type: file
    disableDeletion: true
    # The files are generated: edits in the UI would be lost at the next generate.
    allowUiUpdates: false
    updateIntervalSeconds: 30
    options:
      path: {CONTAINER_DASHBOARDS}
"""

DATASOURCE = HEADER + f"""apiVersion: 1
datasources:
  - name: {DATASOURCE_UID}
    uid: {DATASOURCE_UID}
    type: prometheus
    access: proxy
    url: http://prometheus:9090
    isDefault: true
    editable: false
    jsonData:
      # The scrape interval: Grafana sizes $__rate_interval from it (>= 4 scrapes).
      timeInterval: 5s
"""


def rules_yaml(rules: Iterable[Rule] = RULES, alerts: Iterable[Alert] = ALERTS) -> str:
    # Expressions are written as JSON strings, which YAML reads as double-quoted scalars, so
    # no PromQL character needs YAML escaping by hand.
    lines = [HEADER.rstrip("\n"), "groups:", "  - name: traind", "    rules:"]
    for r in rules:
        lines += [f"      # {r.why}", f"      - record: {r.record}",
                  f"        expr: {json.dumps(r.expr)}"]
    lines += ["  - name: traind-alerts", "    rules:"]
    for a in alerts:
        lines += [f"      - alert: {a.alert}", f"        expr: {json.dumps(a.expr)}",
                  f"        for: {a.for_}", "        labels:",
                  f"          severity: {a.severity}", "        annotations:",
                  f"          summary: {json.dumps(a.summary)}"]
    return "\n".join(lines) + "\n"


def files() -> dict[str, str]:
    """Every generated file, by path relative to the docker/ folder."""
    out = {
        f"grafana/dashboards/{key}.json": json.dumps(dashboard(key), indent=2, sort_keys=True)
        + "\n" for key in DASHBOARDS}
    out["grafana/provisioning/dashboards/traind.yaml"] = DASHBOARD_PROVIDER
    out["grafana/provisioning/datasources/prometheus.yaml"] = DATASOURCE
    out["prometheus/rules.yml"] = rules_yaml()
    return out


def generate(out_dir: Path) -> list[Path]:
    """Write :func:`files` under ``out_dir`` (the repository's ``docker/``); the paths written.

    Stale dashboards (a key removed from DASHBOARDS) are deleted, so provisioning never keeps
    serving a dashboard that the code no longer defines.
    """
    wanted = files()
    dash_dir = out_dir / "grafana" / "dashboards"
    if dash_dir.is_dir():
        for old in dash_dir.glob("*.json"):
            if f"grafana/dashboards/{old.name}" not in wanted:
                old.unlink()
    written = []
    for rel, text in wanted.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
