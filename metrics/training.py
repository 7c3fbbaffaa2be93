"""Training metrics, updated from worker events. The registry is passed in (never a global),
so every daemon and every test builds its own. Every family here is run-labelled: a finished
run's series leave after the retention (metrics/retention.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from traind.contracts.events import (
    ArmEvent,
    CommEvent,
    DataEvent,
    EvalEvent,
    Event,
    LayerEvent,
    LifecycleEvent,
    LinkEvent,
    NumericsEvent,
    PipelineEvent,
    PrecisionEvent,
    ProbeEvent,
    SNREvent,
    StepEvent,
)
from traind.metrics.arithmetic import BUS_FACTORS, bus_bandwidth, window_bandwidth
from traind.metrics.binned import BinnedHistogram
from traind.metrics.catalog import counter, gauge, histogram
from traind.metrics.retention import RETENTION_SECONDS, Expiry, RunSeries
from traind.metrics.throughput import Throughput, rate

if TYPE_CHECKING:
    from collections.abc import Callable

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from traind.metrics.goodput import Goodput
    from traind.metrics.straggler import StepSkew, Straggler

PHASES = ("data", "forward", "backward", "optimizer")
MODES = ("fp32", "bf16", "fp16", "fp8")
M = TypeVar("M", bound="MetricWrapperBase")


@dataclass(slots=True)
class _RunState:
    """What a run's events are folded with, besides the series: dropped with them."""

    world_size: int = 1  # from the started events
    speed: dict[str, Throughput] = field(default_factory=dict)  # per rank
    # DataEvents are cumulative (a lost event loses nothing): counters add the difference
    # from the last one per rank.
    data_last: dict[str, DataEvent] = field(default_factory=dict)
    # goodput's counters as last exported: each rises by the difference
    goodput_last: dict[str, float] = field(default_factory=dict)


def compression_ratio(event: CommEvent) -> float:
    """What compression saves on the wire: the modelled wire bytes of the fp32 all-reduce of
    the same gradients over the modelled wire bytes sent (``sent_bytes``; both ring models
    of measured payloads, trainer/compression/_math.py). 1 uncompressed at any number of
    ranks; an event without its group's size (an older producer) reads raw over sent."""
    if event.world_size < 2:
        return event.raw_bytes / event.sent_bytes
    return event.raw_bytes * BUS_FACTORS["all_reduce"](event.world_size) / event.sent_bytes


class TrainingMetrics:
    """The training and communication families, updated from worker events.

    ``finished(run)`` when a run ends: its series stay ``retention_seconds`` (by ``clock``),
    then leave at the next event or scrape."""

    def __init__(self, registry: CollectorRegistry, *,
                 retention_seconds: float = RETENTION_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.series = RunSeries(retention_seconds, clock)
        self._runs: dict[str, _RunState] = {}
        # First, so that a scrape expires before the families below are collected.
        Expiry(registry, self.expire)
        # Names, help, labels and buckets live in the catalog.
        self.loss = gauge(registry, "traind_train_loss")
        self.val_loss = gauge(registry, "traind_validation_loss")
        self.lr = gauge(registry, "traind_learning_rate")
        self.grad_norm = gauge(registry, "traind_grad_norm")
        self.step = gauge(registry, "traind_train_step")
        self.tokens = counter(registry, "traind_train_tokens")
        self.steps = counter(registry, "traind_train_steps")
        self.tps = gauge(registry, "traind_train_tokens_per_second")
        self.step_seconds = histogram(registry, "traind_step_duration_seconds")
        self.phase_seconds = histogram(registry, "traind_step_phase_duration_seconds")
        self.dropped = gauge(registry, "traind_worker_events_dropped")
        self.checkpoints = counter(registry, "traind_checkpoints")
        self.checkpoint_seconds = gauge(registry, "traind_checkpoint_duration_seconds")
        self.arrival_skew = histogram(registry, "traind_rank_arrival_skew_seconds")
        self.straggler_rank = gauge(registry, "traind_straggler_rank")
        self.straggler_confidence = gauge(registry, "traind_straggler_confidence_ratio")
        self.goodput_seconds = counter(registry, "traind_goodput_seconds")
        self.badput_seconds = counter(registry, "traind_badput_seconds")
        self.goodput_ratio = gauge(registry, "traind_goodput_ratio")
        self.ettr = gauge(registry, "traind_effective_training_time_ratio")
        self.params = gauge(registry, "traind_model_parameters")
        self.loss_scale = gauge(registry, "traind_loss_scale")
        self.skipped = counter(registry, "traind_train_skipped_steps")
        self.precision_mode = gauge(registry, "traind_precision_mode")
        self.precision_switches = counter(registry, "traind_precision_switches")
        self.precision_snr = gauge(registry, "traind_precision_gradient_snr")
        self.comm_raw = counter(registry, "traind_comm_gradient_bytes")
        self.comm_sent = counter(registry, "traind_comm_sent_bytes")
        self.comm_ratio = gauge(registry, "traind_comm_compression_ratio")
        self.comm_error = gauge(registry, "traind_comm_compression_error_ratio")
        self.comm_hook = counter(registry, "traind_comm_hook_seconds")
        self.comm_wait = counter(registry, "traind_comm_allreduce_seconds")
        self.comm_buckets = counter(registry, "traind_comm_buckets")
        self.layer_grad = gauge(registry, "traind_layer_grad_norm")
        self.layer_weight = gauge(registry, "traind_layer_weight_norm")
        self.layer_update = gauge(registry, "traind_layer_update_ratio")
        self.coll_calls = counter(registry, "traind_comm_collective_calls")
        self.coll_bytes = counter(registry, "traind_comm_collective_bytes")
        self.coll_latency = BinnedHistogram(registry, "traind_comm_collective_latency_seconds")
        self.coll_busbw = gauge(registry,
                                "traind_comm_collective_bus_bandwidth_bytes_per_second")
        self.coll_algbw = gauge(registry,
                                "traind_comm_collective_algorithm_bandwidth_bytes_per_second")
        self.data_hits = counter(registry, "traind_data_cache_hits")
        self.data_misses = counter(registry, "traind_data_cache_misses")
        self.data_write_errors = counter(registry, "traind_data_cache_write_errors")
        self.data_filtered = counter(registry, "traind_data_filtered_documents")
        self.data_filtered_bytes = counter(registry, "traind_data_filtered_bytes")
        self.data_filtered_tokens = counter(registry, "traind_data_filtered_tokens")
        self.data_tokens = gauge(registry, "traind_data_tokens")
        self.data_tier_hits = counter(registry, "traind_data_tier_hits")
        self.data_tier_misses = counter(registry, "traind_data_tier_misses")
        self.data_tier_wait = counter(registry, "traind_data_tier_wait_seconds")
        self.data_docs = gauge(registry, "traind_data_documents")
        self.data_bytes = gauge(registry, "traind_data_corpus_bytes")
        self.data_batches = counter(registry, "traind_data_batches")
        self.data_depth = gauge(registry, "traind_data_prefetch_depth")
        self.data_depth_mean = gauge(registry, "traind_data_prefetch_depth_mean")
        self.data_capacity = gauge(registry, "traind_data_prefetch_capacity")
        self.data_wait = counter(registry, "traind_data_wait_seconds")
        self.ddp_seconds = gauge(registry, "traind_ddp_seconds")
        self.ddp_overlap = gauge(registry, "traind_ddp_overlap_ratio")
        self.probe_latency = gauge(registry, "traind_comm_probe_latency_seconds")
        self.probe_busbw = gauge(registry, "traind_comm_probe_bus_bandwidth_bytes_per_second")
        self.flops_per_token = gauge(registry, "traind_model_flops_per_token")
        self.peak_flops = gauge(registry, "traind_device_peak_flops")
        self.nonfinite = counter(registry, "traind_train_nonfinite_steps")
        self.cuda_memory = gauge(registry, "traind_cuda_memory_bytes")
        self.cuda_retries = gauge(registry, "traind_cuda_alloc_retries")
        self.cuda_ooms = gauge(registry, "traind_cuda_ooms")
        self.arm_blocks = counter(registry, "traind_arm_blocks")
        self.arm_tps = gauge(registry, "traind_arm_tokens_per_second")
        self.arm_loss = gauge(registry, "traind_arm_block_loss")
        self.numerics_actions = counter(registry, "traind_numerics_actions")
        self.numerics_rolled_back = counter(registry, "traind_numerics_rolled_back_steps")
        self.pp_bubble = gauge(registry, "traind_pipeline_bubble_ratio")
        self.pp_bubble_theory = gauge(registry, "traind_pipeline_bubble_theoretical_ratio")
        self.pp_busy = gauge(registry, "traind_pipeline_stage_busy_seconds")
        self.pp_idle = gauge(registry, "traind_pipeline_stage_idle_seconds")
        self.link_latency = gauge(registry, "traind_link_latency_seconds")
        self.link_bandwidth = gauge(registry, "traind_link_bandwidth_bytes_per_second")
        self.link_seconds = gauge(registry, "traind_link_probe_duration_seconds")
        self.pp_p2p_bytes = gauge(registry, "traind_pipeline_p2p_bytes")
        self.pp_p2p_messages = gauge(registry, "traind_pipeline_p2p_messages")
        self.pp_p2p_wait = gauge(registry, "traind_pipeline_p2p_wait_seconds")

    def finished(self, run: int, at: float | None = None) -> None:
        """The run ended (at ``at`` by the clock; now if not given): its series leave once
        the retention has passed."""
        self.series.finished(str(run), at)

    def expire(self) -> list[str]:
        """Drop the series and state of the finished runs past their retention (lazily: at
        each event and scrape); the runs that left."""
        gone = self.series.expire()
        for run in gone:
            self._runs.pop(run, None)
        return gone

    def _at(self, family: M, run: str, *labels: str) -> M:
        """``family``'s child for ``(run, *labels)``, remembered for the run's retention."""
        key = (run, *labels)
        self.series.track(run, family, key)
        return family.labels(*key)

    def _state(self, run: str) -> _RunState:
        state = self._runs.get(run)
        if state is None:
            state = self._runs[run] = _RunState()
        return state

    def observe(self, run: int, event: Event) -> None:
        self.expire()
        lab = (str(run), str(event.rank))
        if isinstance(event, StepEvent):
            self._at(self.loss, *lab).set(event.loss)
            self._at(self.lr, *lab).set(event.lr)
            self._at(self.grad_norm, *lab).set(event.grad_norm)
            self._at(self.step, *lab).set(event.step)
            # Counters count every step, also those between telemetry reports.
            self._at(self.steps, *lab).inc(event.steps)
            self._at(self.tokens, *lab).inc(event.tokens * event.steps)
            self._tokens_per_second(lab, event)
            self._at(self.step_seconds, *lab).observe(event.step_seconds)
            for phase in PHASES:
                self._at(self.phase_seconds, *lab, phase).observe(
                    getattr(event, f"{phase}_seconds"))
            self._at(self.dropped, *lab).set(event.dropped_events)
            self._at(self.loss_scale, *lab).set(event.loss_scale)
            self._at(self.skipped, *lab).inc(event.skipped_steps)
            if event.nonfinite:
                self._at(self.nonfinite, *lab).inc()
            mem = event.cuda_memory
            if mem:
                for kind in ("allocated", "reserved", "peak_allocated"):
                    self._at(self.cuda_memory, *lab, kind).set(mem.get(f"{kind}_bytes", 0.0))
                self._at(self.cuda_retries, *lab).set(mem.get("alloc_retries", 0.0))
                self._at(self.cuda_ooms, *lab).set(mem.get("ooms", 0.0))
        elif isinstance(event, CommEvent):
            c = (*lab, event.mesh_dim, event.method)
            self._at(self.comm_wait, *c).inc(event.allreduce_seconds)
            if event.mesh_dim == "dp":  # the gradient hook's figures: only dp's events have them
                self._at(self.comm_raw, *c).inc(event.raw_bytes)
                self._at(self.comm_sent, *c).inc(event.sent_bytes)
                if event.sent_bytes:
                    self._at(self.comm_ratio, *c).set(compression_ratio(event))
                self._at(self.comm_error, *c).set(event.rel_error)
                self._at(self.comm_hook, *c).inc(event.hook_seconds)
                self._at(self.comm_buckets, *c).inc(event.buckets)
            self._collectives(lab, event)
        elif isinstance(event, DataEvent):
            self._data(lab, event)
        elif isinstance(event, LayerEvent):
            for i, name in enumerate(event.layers):
                self._at(self.layer_grad, str(run), name).set(event.grad_norm[i])
                self._at(self.layer_weight, str(run), name).set(event.weight_norm[i])
                self._at(self.layer_update, str(run), name).set(event.update_ratio[i])
        elif isinstance(event, ProbeEvent):
            for size, seconds in zip(event.sizes, event.seconds, strict=True):
                p = (*lab, event.mesh_dim, event.op, str(size))
                self._at(self.probe_latency, *p).set(seconds)
                self._at(self.probe_busbw, *p).set(
                    bus_bandwidth(size, seconds, event.world_size, event.op))
        elif isinstance(event, ArmEvent):
            a = (*lab, event.arm)
            self._at(self.arm_blocks, *a).inc()
            if not math.isnan(tps := rate(event.tokens, event.seconds)):
                self._at(self.arm_tps, *a).set(tps)
            self._at(self.arm_loss, *a).set(event.loss)
        elif isinstance(event, PrecisionEvent):
            self._set_mode(lab, event.group, event.after)
            self._at(self.precision_switches, *lab, event.group, event.after).inc()
            self._at(self.precision_snr, *lab, event.group).set(event.snr)
        elif isinstance(event, SNREvent):  # every report: every group's figure and mode
            for group, snr, mode in zip(event.groups, event.snr, event.modes, strict=True):
                self._at(self.precision_snr, *lab, group).set(snr)
                self._set_mode(lab, group, mode)
        elif isinstance(event, NumericsEvent):
            self._at(self.numerics_actions, *lab, event.action, event.reason).inc()
            self._at(self.numerics_rolled_back, *lab).inc(event.skipped_batches)
        elif isinstance(event, PipelineEvent):
            st = (*lab, str(event.stage))
            self._at(self.pp_bubble, *st).set(event.bubble)
            self._at(self.pp_bubble_theory, *st).set(event.bubble_theory)
            self._at(self.pp_busy, *st).set(event.busy_seconds)
            self._at(self.pp_idle, *st).set(event.idle_seconds)
            for p2p in event.p2p:
                link = (*st, p2p["direction"], p2p["op"])
                self._at(self.pp_p2p_bytes, *link).set(p2p["bytes"])
                self._at(self.pp_p2p_messages, *link).set(p2p["calls"])
                if "seconds" in p2p:
                    self._at(self.pp_p2p_wait, *link).set(p2p["seconds"])
        elif isinstance(event, LinkEvent):
            self._links(str(run), event)
        elif isinstance(event, EvalEvent):
            self._at(self.val_loss, *lab).set(event.val_loss)
        elif isinstance(event, LifecycleEvent):
            self._lifecycle(lab, event)

    def goodput(self, run: int, figures: Goodput) -> None:
        """A run's goodput now (the supervisor folds it: metrics/goodput.py). Counters rise
        by what was added since the last call; a figure never goes back (goodput is the
        committed time for that reason)."""
        label = str(run)
        last = self._state(label).goodput_last
        rises = {"": figures.committed, **figures.badput}
        for kind, value in rises.items():
            step = value - last.get(kind, 0.0)
            if step <= 0:
                continue
            last[kind] = value
            if kind:
                self._at(self.badput_seconds, label, kind).inc(step)
            else:
                self._at(self.goodput_seconds, label).inc(step)
        self._at(self.goodput_ratio, label).set(figures.ratio)
        self._at(self.ettr, label).set(figures.ettr)

    def _lifecycle(self, lab: tuple[str, str], event: LifecycleEvent) -> None:
        run, d = lab[0], event.detail
        if event.phase == "checkpoint":
            self._at(self.checkpoints, *lab).inc()
            self._at(self.checkpoint_seconds, *lab).set(float(d.get("seconds", 0)))
            return
        if event.phase == "started":  # every rank's: new workers, timed afresh
            state = self._state(run)
            state.world_size = int(d.get("world_size", state.world_size))
            state.speed.pop(lab[1], None)
            if d.get("peak_flops"):  # each rank's device: MFU divides by their sum
                self._at(self.peak_flops, *lab).set(d["peak_flops"])
        if event.phase in ("started", "resumed") and event.rank == 0:
            for group, mode in d.get("precision_modes", {}).items():
                self._set_mode(lab, group, mode)
            if "params" in d:
                self._at(self.params, run).set(d["params"])
            if "flops_per_token" in d:
                self._at(self.flops_per_token, run).set(d["flops_per_token"])

    def straggler(self, run: int, skew: StepSkew, verdict: Straggler) -> None:
        """A step whose every rank's arrival is in, and the verdict after it (the supervisor
        folds every rank's arrivals: metrics/straggler.py)."""
        label = str(run)
        self._at(self.arrival_skew, label).observe(skew.skew)
        self._at(self.straggler_rank, label).set(-1 if verdict.rank is None else verdict.rank)
        self._at(self.straggler_confidence, label).set(verdict.confidence)

    def _links(self, run: str, event: LinkEvent) -> None:
        """The matrix, one series per ordered pair (a rank to itself is not a link)."""
        self._at(self.link_seconds, run).set(event.seconds)
        for src, (lat_row, bw_row) in enumerate(zip(event.latency, event.bandwidth,
                                                    strict=True)):
            for dst, (lat, bw) in enumerate(zip(lat_row, bw_row, strict=True)):
                if src != dst:
                    self._at(self.link_latency, run, str(src), str(dst)).set(lat)
                    self._at(self.link_bandwidth, run, str(src), str(dst)).set(bw)

    def _tokens_per_second(self, lab: tuple[str, str], event: StepEvent) -> None:
        """The job's throughput as this rank's reports see it (metrics/throughput.py): ranks
        run in lock step, so every rank's series shows the job's figure."""
        state = self._state(lab[0])
        speed = state.speed.get(lab[1])
        if speed is None:
            speed = state.speed[lab[1]] = Throughput()
        speed.observe(event, state.world_size)
        if speed.seconds > 0:
            self._at(self.tps, *lab).set(speed.smoothed)

    def _data(self, lab: tuple[str, str], e: DataEvent) -> None:
        data_last = self._state(lab[0]).data_last
        last = data_last.get(lab[1])
        data_last[lab[1]] = e
        if last is not None and e.batches_served < last.batches_served:
            last = None  # the rank restarted (a resume): its counts began again from zero

        def grow(field: str, key: str | None = None) -> float:
            """The rise of a cumulative field since the last event."""
            def value(ev: DataEvent | None) -> float:
                if ev is None:
                    return 0.0
                v = getattr(ev, field)
                return float(v.get(key, 0) if key is not None else v)
            return max(0.0, value(e) - value(last))

        for tier in e.cache_hits:
            self._at(self.data_hits, *lab, tier).inc(grow("cache_hits", tier))
        for tier in e.cache_misses:
            self._at(self.data_misses, *lab, tier).inc(grow("cache_misses", tier))
        for reason in e.filtered:
            self._at(self.data_filtered, *lab, reason).inc(grow("filtered", reason))
        for reason in e.filtered_bytes:
            self._at(self.data_filtered_bytes, *lab, reason).inc(grow("filtered_bytes", reason))
            self._at(self.data_filtered_tokens, *lab, reason).inc(
                grow("filtered_tokens", reason))
        for tier in e.tier_hits:
            self._at(self.data_tier_hits, *lab, tier).inc(grow("tier_hits", tier))
            self._at(self.data_tier_misses, *lab, tier).inc(grow("tier_misses", tier))
            self._at(self.data_tier_wait, *lab, tier).inc(grow("tier_wait_seconds", tier))
        self._at(self.data_tokens, *lab).set(e.tokens_kept)
        self._at(self.data_write_errors, *lab).inc(grow("cache_write_errors"))
        self._at(self.data_batches, *lab).inc(grow("batches_served"))
        self._at(self.data_wait, *lab).inc(grow("prefetch_wait_seconds"))
        self._at(self.data_docs, *lab).set(e.documents_kept)
        self._at(self.data_bytes, *lab).set(e.bytes_kept)
        self._at(self.data_depth, *lab).set(e.prefetch_depth_last)
        self._at(self.data_depth_mean, *lab).set(e.prefetch_depth_mean)
        self._at(self.data_capacity, *lab).set(e.prefetch_capacity)

    def _collectives(self, lab: tuple[str, str], event: CommEvent) -> None:
        for c in event.collectives:
            key = (*lab, event.mesh_dim, c["op"], c["size"])
            self._at(self.coll_calls, *key).inc(c["calls"])
            self._at(self.coll_bytes, *key).inc(c["bytes"])
            self.series.track(lab[0], self.coll_latency, key)
            self.coll_latency.add(key, c["counts"], c["seconds"])
            if c["seconds"] > 0 and c["calls"]:
                algbw, busbw = window_bandwidth(c["op"], c["bytes"], c["seconds"],
                                                event.world_size)
                self._at(self.coll_algbw, *key).set(algbw)
                self._at(self.coll_busbw, *key).set(busbw)
        dim = (*lab, event.mesh_dim)
        for phase, seconds in event.ddp.items():
            self._at(self.ddp_seconds, *dim, phase).set(seconds)
        if event.ddp.get("backward_comm"):
            self._at(self.ddp_overlap, *dim).set(
                min(1.0, event.ddp["backward_overlap"] / event.ddp["backward_comm"]))

    def _set_mode(self, lab: tuple[str, str], group: str, mode: str) -> None:
        # An enum as one series per value (node_exporter style): 1 for the current, 0 others.
        for m in MODES:
            self._at(self.precision_mode, *lab, group, m).set(1.0 if m == mode else 0.0)
