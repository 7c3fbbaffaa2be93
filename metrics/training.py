"""Training metrics, updated from worker events. The registry is passed in (never a global),
so every daemon and every test builds its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from traind.metrics.arithmetic import bus_bandwidth
from traind.trainer.events import (
    CommEvent,
    EvalEvent,
    Event,
    LayerEvent,
    LifecycleEvent,
    PrecisionEvent,
    ProbeEvent,
    StepEvent,
)

PHASES = ("data", "forward", "backward", "optimizer")
MODES = ("fp32", "bf16", "fp16", "fp8")
# Step phases on this machine range from ~100 µs (optimizer of a tiny model) to seconds.
PHASE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0)


class TrainingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["run", "rank"]
        self.loss = Gauge("traind_train_loss", "Training loss of the last reported step "
                          "(cross-entropy, nats per token).", labels, registry=registry)
        self.val_loss = Gauge("traind_validation_loss", "Loss on the held-out split at the last "
                              "evaluation (nats per token).", labels, registry=registry)
        self.lr = Gauge("traind_learning_rate", "Learning rate of the last step.", labels,
                        registry=registry)
        self.grad_norm = Gauge("traind_grad_norm", "Global L2 norm of the gradients before "
                               "clipping.", labels, registry=registry)
        self.step = Gauge("traind_train_step", "Last optimizer step reported.", labels,
                          registry=registry)
        self.tokens = Counter("traind_train_tokens", "Tokens trained on.", labels,
                              registry=registry)
        self.steps = Counter("traind_train_steps", "Optimizer steps reported.", labels,
                             registry=registry)
        self.tps = Gauge("traind_train_tokens_per_second", "Tokens per second of the last "
                         "reported step (use rate(traind_train_tokens_total) for averages).",
                         labels, registry=registry)
        self.step_seconds = Histogram("traind_step_duration_seconds", "Wall time of one "
                                      "optimizer step.", labels, buckets=PHASE_BUCKETS,
                                      registry=registry)
        self.phase_seconds = Histogram("traind_step_phase_duration_seconds", "Wall time of one "
                                       "phase of a step.", [*labels, "phase"],
                                       buckets=PHASE_BUCKETS, registry=registry)
        self.dropped = Gauge("traind_worker_events_dropped", "Events a worker could not queue "
                             "for the daemon (cumulative per worker process).", labels,
                             registry=registry)
        self.checkpoints = Counter("traind_checkpoints", "Checkpoints written.", labels,
                                   registry=registry)
        self.checkpoint_seconds = Gauge("traind_checkpoint_duration_seconds", "Time to write "
                                        "the last checkpoint.", labels, registry=registry)
        self.params = Gauge("traind_model_parameters", "Trainable parameters of the model.",
                            ["run"], registry=registry)
        self.loss_scale = Gauge("traind_loss_scale", "fp16 GradScaler scale after the last "
                                "reported step (1 without a scaler).", labels, registry=registry)
        self.skipped = Counter("traind_train_skipped_steps", "Optimizer steps skipped for "
                               "inf/NaN gradients (fp16 overflow).", labels, registry=registry)
        self.precision_mode = Gauge("traind_precision_mode", "1 for the compute precision each "
                                    "parameter group runs in now, 0 for the others.",
                                    [*labels, "group", "mode"], registry=registry)
        self.precision_switches = Counter("traind_precision_switches", "Adaptive precision "
                                          "switches, by group and the mode switched to.",
                                          [*labels, "group", "mode"], registry=registry)
        self.precision_snr = Gauge("traind_precision_gradient_snr", "Gradient signal-to-noise "
                                   "ratio of a group when it last switched.",
                                   [*labels, "group"], registry=registry)
        comm = [*labels, "method"]
        self.comm_raw = Counter("traind_comm_gradient_bytes", "Gradient bytes handed to the "
                                "communication hook, before compression.", comm,
                                registry=registry)
        self.comm_sent = Counter("traind_comm_sent_bytes", "Gradient bytes this rank put on "
                                 "the wire after compression.", comm, registry=registry)
        self.comm_ratio = Gauge("traind_comm_compression_ratio", "Raw over sent bytes in the "
                                "last report (1 = uncompressed).", comm, registry=registry)
        self.comm_error = Gauge("traind_comm_compression_error_ratio", "Relative compression "
                                "error ||g_hat - g|| / ||g|| in the last report.", comm,
                                registry=registry)
        self.comm_hook = Counter("traind_comm_hook_seconds", "Time compressing and "
                                 "decompressing gradients.", comm, registry=registry)
        self.comm_wait = Counter("traind_comm_allreduce_seconds", "Time waiting in gradient "
                                 "collectives.", comm, registry=registry)
        self.comm_buckets = Counter("traind_comm_buckets", "Gradient buckets communicated.",
                                    comm, registry=registry)
        layer = ["run", "layer"]
        self.layer_grad = Gauge("traind_layer_grad_norm", "L2 norm of one layer's gradients "
                                "(before clipping).", layer, registry=registry)
        self.layer_weight = Gauge("traind_layer_weight_norm", "L2 norm of one layer's "
                                  "weights.", layer, registry=registry)
        self.layer_update = Gauge("traind_layer_update_ratio", "||W_after - W_before|| / "
                                  "||W|| of one layer at the last report.", layer,
                                  registry=registry)
        probe = [*labels, "op", "size_bytes"]
        self.probe_latency = Gauge("traind_comm_probe_latency_seconds", "Median time of one "
                                   "collective of this size in the last probe.", probe,
                                   registry=registry)
        self.probe_busbw = Gauge("traind_comm_probe_bus_bandwidth_bytes_per_second",
                                 "Bus bandwidth of the probe's collective (nccl-tests "
                                 "factors).", probe, registry=registry)
        self.flops_per_token = Gauge("traind_model_flops_per_token", "Training FLOPs per "
                                     "token (forward and backward).", ["run"],
                                     registry=registry)

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
        elif isinstance(event, PrecisionEvent):
            self._set_mode(lab, event.group, event.after)
            self.precision_switches.labels(*lab, event.group, event.after).inc()
            self.precision_snr.labels(*lab, event.group).set(event.snr)
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

    def _set_mode(self, lab: tuple[str, str], group: str, mode: str) -> None:
        # An enum as one series per value (node_exporter style): 1 for the current, 0 others.
        for m in MODES:
            self.precision_mode.labels(*lab, group, m).set(1.0 if m == mode else 0.0)
