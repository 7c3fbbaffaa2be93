"""Training metrics, updated from worker events. The registry is passed in (never a global),
so every daemon and every test builds its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from traind.metrics.arithmetic import bus_bandwidth, nccl_size
from traind.metrics.binned import BinnedHistogram
from traind.metrics.catalog import counter, gauge, histogram
from traind.trainer.events import (
    ArmEvent,
    CommEvent,
    DataEvent,
    EvalEvent,
    Event,
    LayerEvent,
    LifecycleEvent,
    NumericsEvent,
    PrecisionEvent,
    ProbeEvent,
    SNREvent,
    StepEvent,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

PHASES = ("data", "forward", "backward", "optimizer")
MODES = ("fp32", "bf16", "fp16", "fp8")


class TrainingMetrics:
    """The training and communication families, updated from worker events."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
        self.data_docs = gauge(registry, "traind_data_documents")
        self.data_bytes = gauge(registry, "traind_data_corpus_bytes")
        self.data_batches = counter(registry, "traind_data_batches")
        self.data_depth = gauge(registry, "traind_data_prefetch_depth")
        self.data_depth_mean = gauge(registry, "traind_data_prefetch_depth_mean")
        self.data_capacity = gauge(registry, "traind_data_prefetch_capacity")
        self.data_wait = counter(registry, "traind_data_wait_seconds")
        # DataEvents are cumulative (a lost event loses nothing): counters add the difference
        # from the last one per (run, rank).
        self._data_last: dict[tuple[str, str], DataEvent] = {}
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

    def observe(self, run: int, event: Event) -> None:
        lab = (str(run), str(event.rank))
        if isinstance(event, StepEvent):
            self.loss.labels(*lab).set(event.loss)
            self.lr.labels(*lab).set(event.lr)
            self.grad_norm.labels(*lab).set(event.grad_norm)
            self.step.labels(*lab).set(event.step)
            # Counters count every step, also those between telemetry reports.
            self.steps.labels(*lab).inc(event.steps)
            self.tokens.labels(*lab).inc(event.tokens * event.steps)
            if event.step_seconds > 0:
                self.tps.labels(*lab).set(event.tokens / event.step_seconds)
            self.step_seconds.labels(*lab).observe(event.step_seconds)
            for phase in PHASES:
                self.phase_seconds.labels(*lab, phase).observe(
                    getattr(event, f"{phase}_seconds"))
            self.dropped.labels(*lab).set(event.dropped_events)
            self.loss_scale.labels(*lab).set(event.loss_scale)
            self.skipped.labels(*lab).inc(event.skipped_steps)
            if event.nonfinite:
                self.nonfinite.labels(*lab).inc()
            mem = event.cuda_memory
            if mem:
                for kind in ("allocated", "reserved", "peak_allocated"):
                    self.cuda_memory.labels(*lab, kind).set(mem.get(f"{kind}_bytes", 0.0))
                self.cuda_retries.labels(*lab).set(mem.get("alloc_retries", 0.0))
                self.cuda_ooms.labels(*lab).set(mem.get("ooms", 0.0))
        elif isinstance(event, CommEvent):
            c = (*lab, event.method)
            self.comm_raw.labels(*c).inc(event.raw_bytes)
            self.comm_sent.labels(*c).inc(event.sent_bytes)
            if event.sent_bytes:
                self.comm_ratio.labels(*c).set(event.raw_bytes / event.sent_bytes)
            self.comm_error.labels(*c).set(event.rel_error)
            self.comm_hook.labels(*c).inc(event.hook_seconds)
            self.comm_wait.labels(*c).inc(event.allreduce_seconds)
            self.comm_buckets.labels(*c).inc(event.buckets)
            self._collectives(lab, event)
        elif isinstance(event, DataEvent):
            self._data(lab, event)
        elif isinstance(event, LayerEvent):
            for i, name in enumerate(event.layers):
                self.layer_grad.labels(str(run), name).set(event.grad_norm[i])
                self.layer_weight.labels(str(run), name).set(event.weight_norm[i])
                self.layer_update.labels(str(run), name).set(event.update_ratio[i])
        elif isinstance(event, ProbeEvent):
            for size, seconds in zip(event.sizes, event.seconds, strict=True):
                p = (*lab, event.op, str(size))
                self.probe_latency.labels(*p).set(seconds)
                self.probe_busbw.labels(*p).set(
                    bus_bandwidth(size, seconds, event.world_size, event.op))
        elif isinstance(event, ArmEvent):
            a = (*lab, event.arm)
            self.arm_blocks.labels(*a).inc()
            if event.seconds > 0:
                self.arm_tps.labels(*a).set(event.tokens / event.seconds)
            self.arm_loss.labels(*a).set(event.loss)
        elif isinstance(event, PrecisionEvent):
            self._set_mode(lab, event.group, event.after)
            self.precision_switches.labels(*lab, event.group, event.after).inc()
            self.precision_snr.labels(*lab, event.group).set(event.snr)
        elif isinstance(event, SNREvent):  # every report: every group's figure and mode
            for group, snr, mode in zip(event.groups, event.snr, event.modes, strict=True):
                self.precision_snr.labels(*lab, group).set(snr)
                self._set_mode(lab, group, mode)
        elif isinstance(event, NumericsEvent):
            self.numerics_actions.labels(*lab, event.action, event.reason).inc()
            self.numerics_rolled_back.labels(*lab).inc(event.skipped_batches)
        elif isinstance(event, EvalEvent):
            self.val_loss.labels(*lab).set(event.val_loss)
        elif isinstance(event, LifecycleEvent):
            if event.phase == "checkpoint":
                self.checkpoints.labels(*lab).inc()
                self.checkpoint_seconds.labels(*lab).set(float(event.detail.get("seconds", 0)))
            elif event.phase in ("started", "resumed") and event.rank == 0:
                for group, mode in event.detail.get("precision_modes", {}).items():
                    self._set_mode(lab, group, mode)
                if "params" in event.detail:
                    self.params.labels(str(run)).set(event.detail["params"])
                if "flops_per_token" in event.detail:
                    self.flops_per_token.labels(str(run)).set(event.detail["flops_per_token"])
                if event.detail.get("peak_flops"):
                    self.peak_flops.labels(str(run)).set(event.detail["peak_flops"])

    def _data(self, lab: tuple[str, str], e: DataEvent) -> None:
        last = self._data_last.get(lab)
        self._data_last[lab] = e
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
            self.data_hits.labels(*lab, tier).inc(grow("cache_hits", tier))
        for tier in e.cache_misses:
            self.data_misses.labels(*lab, tier).inc(grow("cache_misses", tier))
        for reason in e.filtered:
            self.data_filtered.labels(*lab, reason).inc(grow("filtered", reason))
        self.data_write_errors.labels(*lab).inc(grow("cache_write_errors"))
        self.data_batches.labels(*lab).inc(grow("batches_served"))
        self.data_wait.labels(*lab).inc(grow("prefetch_wait_seconds"))
        self.data_docs.labels(*lab).set(e.documents_kept)
        self.data_bytes.labels(*lab).set(e.bytes_kept)
        self.data_depth.labels(*lab).set(e.prefetch_depth_last)
        self.data_depth_mean.labels(*lab).set(e.prefetch_depth_mean)
        self.data_capacity.labels(*lab).set(e.prefetch_capacity)

    def _collectives(self, lab: tuple[str, str], event: CommEvent) -> None:
        for c in event.collectives:
            key = (*lab, c["op"], c["size"])
            self.coll_calls.labels(*key).inc(c["calls"])
            self.coll_bytes.labels(*key).inc(c["bytes"])
            self.coll_latency.add(key, c["counts"], c["seconds"])
            if c["seconds"] > 0 and c["calls"]:
                # bus_bandwidth takes one message: the window's mean message over its mean time
                size = nccl_size(c["op"], c["bytes"], event.world_size)
                self.coll_algbw.labels(*key).set(size / c["seconds"])
                self.coll_busbw.labels(*key).set(bus_bandwidth(
                    size // c["calls"], c["seconds"] / c["calls"], event.world_size, c["op"]))
        for phase, seconds in event.ddp.items():
            self.ddp_seconds.labels(*lab, phase).set(seconds)
        if event.ddp.get("backward_comm"):
            self.ddp_overlap.labels(*lab).set(
                min(1.0, event.ddp["backward_overlap"] / event.ddp["backward_comm"]))

    def _set_mode(self, lab: tuple[str, str], group: str, mode: str) -> None:
        # An enum as one series per value (node_exporter style): 1 for the current, 0 others.
        for m in MODES:
            self.precision_mode.labels(*lab, group, m).set(1.0 if m == mode else 0.0)
