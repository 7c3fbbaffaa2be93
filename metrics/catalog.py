"""The metric catalog: every family traind exports, declared once.

The registry's families (``build``, ``family``), the docs page (``docs/metrics.md``, see
``markdown``) and the tests that hold a live scrape to it all come from here. Conventions
(Prometheus): base units (seconds, bytes, joules, ratios 0-1), ``_total`` for counters
(prometheus_client appends it: declare counters without it), ``_info`` for metadata, labels
that are ids and enums only (node, run, rank, gpu, link, layer, op, size, method, phase).
Rates are computed in PromQL (recording rules in docker/prometheus/rules.yml), not exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from traind.contracts.comm import LATENCY_BOUNDS

Kind = Literal["gauge", "counter", "histogram", "info"]
RR = ("run", "rank")
# Every communication family's: the mesh dimension whose group communicated (dp, tp, pp;
# contracts.mesh.MESH_DIMS), so one query splits the bytes and time by parallelism.
RRM = (*RR, "mesh_dim")
# Step phases on this machine range from ~100 µs (optimizer of a tiny model) to seconds.
STEP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0)
# arrival skew: from a kernel launch's jitter to a rank seconds behind
SKEW_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 5.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # counters without "_total"
    kind: Kind
    unit: str  # "" for plain numbers
    labels: tuple[str, ...]
    help: str
    source: str  # the collector that exports it
    gpu_only: bool = False
    switch: str = ""  # config switch that turns the family off ("metrics.per_link", ...)
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> str:
        """The name as it appears in a scrape (counters gain ``_total``)."""
        return self.name + "_total" if self.kind == "counter" else self.name


def _m(name: str, kind: Kind, unit: str, labels: tuple[str, ...], help: str, source: str,
       **kw: object) -> MetricSpec:
    return MetricSpec(name, kind, unit, labels, help, source, **kw)  # type: ignore[arg-type]


CATALOG: tuple[MetricSpec, ...] = (
    # -- training (from worker events, every rank) ---------------------------------------------
    _m("traind_train_loss", "gauge", "nats", RR, "Training loss of the last reported step "
       "(cross-entropy per token).", "training"),
    _m("traind_validation_loss", "gauge", "nats", RR, "Loss on the held-out split at the last "
       "evaluation.", "training"),
    _m("traind_learning_rate", "gauge", "", RR, "Learning rate of the last step.", "training"),
    _m("traind_grad_norm", "gauge", "", RR, "Global L2 norm of the gradients before "
       "clipping.", "training"),
    _m("traind_train_step", "gauge", "", RR, "Last optimizer step reported.", "training"),
    _m("traind_train_tokens", "counter", "", RR, "Tokens trained on.", "training"),
    _m("traind_train_steps", "counter", "", RR, "Optimizer steps taken.", "training"),
    _m("traind_train_tokens_per_second", "gauge", "", RR, "The whole job's tokens per second "
       "of wall time, smoothed over ~30 s (metrics/throughput.py), as this rank's reports see "
       "it: ranks run in lock step, so each shows the job's figure (avg by run, never sum). "
       "The same number the live page and the runs page show.", "training"),
    _m("traind_step_duration_seconds", "histogram", "seconds", RR, "Wall time of one "
       "optimizer step.", "training", buckets=STEP_BUCKETS),
    _m("traind_step_phase_duration_seconds", "histogram", "seconds", (*RR, "phase"),
       "Wall time of one phase of a step (data, forward, backward, optimizer).", "training",
       buckets=STEP_BUCKETS),
    _m("traind_worker_events_dropped", "gauge", "", RR, "Events a worker could not queue for "
       "the daemon (cumulative per worker process).", "training"),
    _m("traind_checkpoints", "counter", "", RR, "Checkpoints written.", "training"),
    _m("traind_checkpoint_duration_seconds", "gauge", "seconds", RR, "Time to write the last "
       "checkpoint.", "training"),
    # goodput (metrics/goodput.py, the definition): the lead rank's ledger and the daemon's
    # launch and end stamps
    _m("traind_goodput_seconds", "counter", "seconds", ("run",), "Productive training time "
       "that a checkpoint holds (all of it once the run ends): time spent since the last "
       "checkpoint may still be lost to a failure, so it is counted once saved.", "training"),
    _m("traind_badput_seconds", "counter", "seconds", ("run", "kind"), "Wall time of the run "
       "that was not productive training, by kind: startup, restart, data_wait, "
       "checkpoint_save, checkpoint_restore, evaluation, progress_lost (steps redone after a "
       "restart or rollback), numerics_skip, profiling (writing a trace asked for on demand), "
       "shutdown.", "training"),
    _m("traind_goodput_ratio", "gauge", "ratio", ("run",), "Productive training time over "
       "the run's wall time since its launch (Google's runtime goodput).", "training"),
    _m("traind_effective_training_time_ratio", "gauge", "ratio", ("run",), "ETTR: the run's "
       "wall time less start-up, restarts, restores, lost progress and shutdown, over its "
       "wall time (Meta's effective training time ratio).", "training"),
    # straggler attribution (metrics/straggler.py): arrivals at the gradient collectives
    _m("traind_rank_arrival_skew_seconds", "histogram", "seconds", ("run",), "Per step, the "
       "last rank's arrival at the gradient collectives minus the first's, on the ranks' "
       "shared clock (DDP jobs of 2 or more ranks).", "training", buckets=SKEW_BUCKETS),
    _m("traind_straggler_rank", "gauge", "", ("run",), "The rank that arrives last at the "
       "gradient collectives more often than chance allows (binomial test, p < 0.001, over "
       "the last 200 steps) by more than the clocks' error; -1 when no rank is.", "training"),
    _m("traind_straggler_confidence_ratio", "gauge", "ratio", ("run",), "1 - p of the rank most "
       "often last: the chance that it is not last this often by luck.", "training"),
    _m("traind_model_parameters", "gauge", "", ("run",), "Trainable parameters of the model.",
       "training"),
    _m("traind_model_flops_per_token", "gauge", "", ("run",), "Training FLOPs per token "
       "(forward and backward), counting the attention that runs: a causal query's (T+1)/2 "
       "keys, a sliding window's fewer.", "training"),
    _m("traind_device_peak_flops", "gauge", "", RR, "Datasheet dense peak FLOP/s of "
       "each rank's device in the math the run's matmuls use (bf16, fp8, or TF32 for fp32); "
       "absent when unknown. MFU = the job's tokens/s x FLOPs per token / the sum of these "
       "over its ranks (metrics/throughput.mfu; the rule traind:mfu:ratio_rate1m).",
       "training"),
    _m("traind_train_nonfinite_steps", "counter", "", RR, "Reported steps whose loss was NaN "
       "or infinite.", "training"),
    _m("traind_cuda_memory_bytes", "gauge", "bytes", (*RR, "kind"), "CUDA caching allocator: "
       "allocated, reserved and peak allocated bytes.", "training", gpu_only=True),
    _m("traind_cuda_alloc_retries", "gauge", "", RR, "Allocations the CUDA allocator retried "
       "after freeing its cache (a sign of fragmentation).", "training", gpu_only=True),
    _m("traind_cuda_ooms", "gauge", "", RR, "CUDA out-of-memory errors the allocator raised.",
       "training", gpu_only=True),
    _m("traind_loss_scale", "gauge", "", RR, "fp16 GradScaler scale after the last reported "
       "step (1 without a scaler).", "training"),
    _m("traind_train_skipped_steps", "counter", "", RR, "Optimizer steps skipped for inf/NaN "
       "gradients (fp16 overflow).", "training"),
    _m("traind_precision_mode", "gauge", "", (*RR, "group", "mode"), "1 for the compute "
       "precision each parameter group runs in now, 0 for the others.", "training"),
    _m("traind_precision_switches", "counter", "", (*RR, "group", "mode"), "Adaptive "
       "precision switches, by group and the mode switched to.", "training"),
    _m("traind_precision_gradient_snr", "gauge", "", (*RR, "group"), "Adaptive precision: "
       "mean^2 / variance of a group's gradient norm over the last complete window (above "
       "precision.snr_high the group drops to the low precision, below snr_low it returns "
       "to fp32), set at every telemetry report.", "training"),
    _m("traind_layer_grad_norm", "gauge", "", ("run", "layer"), "L2 norm of one layer's "
       "gradients (before clipping).", "training", switch="telemetry.per_layer"),
    _m("traind_layer_weight_norm", "gauge", "", ("run", "layer"), "L2 norm of one layer's "
       "weights.", "training", switch="telemetry.per_layer"),
    _m("traind_layer_update_ratio", "gauge", "ratio", ("run", "layer"), "||W_after - "
       "W_before|| / ||W|| of one layer at the last report.", "training",
       switch="telemetry.per_layer"),
    _m("traind_numerics_actions", "counter", "", (*RR, "action", "reason"), "Actions of the "
       "numerics policy (fail, skip_step, rollback) by what set them off (nonfinite_loss, "
       "nonfinite_grad, loss_spike).", "training"),
    _m("traind_numerics_rolled_back_steps", "counter", "", RR, "Optimizer steps undone by "
       "rollbacks (their batches are skipped).", "training"),
    _m("traind_experiments", "gauge", "", ("state",), "Experiments by state.", "experiments"),
    _m("traind_experiments_trials", "gauge", "", ("state",), "Trials by state.",
       "experiments"),
    _m("traind_experiments_queue_depth", "gauge", "", (), "Trials waiting to be claimed.",
       "experiments"),
    _m("traind_experiments_lease_expiries", "counter", "", (), "Trials taken over after "
       "their worker's lease expired.", "experiments"),
    _m("traind_scheduler_collector_success", "gauge", "", (), "1 if the scheduler collector "
       "read the database, else 0.", "experiments"),
    _m("traind_scheduler_collector_duration_seconds", "gauge", "seconds", (), "Time the "
       "scheduler collector took.", "experiments"),
    _m("traind_arm_blocks", "counter", "", (*RR, "arm"), "Interleaved A/B blocks measured "
       "per arm.", "experiments"),
    _m("traind_arm_tokens_per_second", "gauge", "", (*RR, "arm"), "This rank's tokens per "
       "second over the arm's last measured block (warm-up steps left out).", "experiments"),
    _m("traind_arm_block_loss", "gauge", "nats", (*RR, "arm"), "Mean training loss of the "
       "arm's last block.", "experiments"),
    # -- pipeline parallel (from worker events, every rank, on report steps) ------------------
    _m("traind_pipeline_bubble_ratio", "gauge", "ratio", (*RR, "stage"), "Fraction of the "
       "last reported pipeline step this rank's stage spent idle, waiting on its neighbours "
       "(1 - busy / step, host time).", "training"),
    _m("traind_pipeline_bubble_theoretical_ratio", "gauge", "ratio", (*RR, "stage"), "The "
       "schedule's bubble with equal stages and free communication, (p - 1) / (m + p - 1) "
       "for GPipe and 1F1B: what traind_pipeline_bubble_ratio is measured against.",
       "training"),
    _m("traind_pipeline_stage_busy_seconds", "gauge", "seconds", (*RR, "stage"), "Host time "
       "the stage computed in the last reported step (forward and backward chunks, the loss "
       "on the last stage).", "training"),
    _m("traind_pipeline_stage_idle_seconds", "gauge", "seconds", (*RR, "stage"), "Host time "
       "the stage waited in the last reported step (the step's wall time less the busy "
       "time).", "training"),
    _m("traind_pipeline_p2p_bytes", "gauge", "bytes", (*RR, "stage", "direction", "op"),
       "Activation bytes the stage sent or received at its boundaries in the last reported "
       "step: direction forward (activations) or backward (their gradients), op send or "
       "recv (mesh_dim pp's traffic).", "training"),
    _m("traind_pipeline_p2p_wait_seconds", "gauge", "seconds",
       (*RR, "stage", "direction", "op"), "Host time the stage blocked waiting on those "
       "sends or receives in the last reported step (a receive's wait holds its "
       "neighbour's compute as well as the transfer).", "training"),
    _m("traind_pipeline_p2p_messages", "gauge", "", (*RR, "stage", "direction", "op"),
       "Point-to-point messages (one per tensor per micro-batch) behind "
       "traind_pipeline_p2p_bytes.", "training"),
    # -- communication ----------------------------------------------------------------------
    _m("traind_comm_gradient_bytes", "counter", "bytes", (*RRM, "method"), "Gradient bytes "
       "handed to the communication hook, before compression (measured: the size of DDP's "
       "bucket buffers).", "comm"),
    _m("traind_comm_sent_bytes", "counter", "bytes", (*RRM, "method"), "Bytes this rank "
       "sends on the wire after compression, modelled, not measured: the bytes it handed "
       "each gradient collective (measured, traind_comm_collective_bytes) times the ring "
       "algorithm's share for N ranks: all-reduce 2(N-1)/N, all-to-all (N-1)/N, all-gather "
       "N-1 (trainer/compression/_math.py WIRE_BYTES).", "comm"),
    _m("traind_comm_compression_ratio", "gauge", "", (*RRM, "method"), "Wire bytes the "
       "fp32 all-reduce of the same gradients would send (traind_comm_gradient_bytes x "
       "2(N-1)/N) over traind_comm_sent_bytes, in the last report: both modelled by ring "
       "formulas from measured payloads. 1 = uncompressed, at any N.", "comm"),
    _m("traind_comm_compression_error_ratio", "gauge", "ratio", (*RRM, "method"), "Relative "
       "compression error ||g_hat - g|| / ||g|| in the last report.", "comm"),
    _m("traind_comm_hook_seconds", "counter", "seconds", (*RRM, "method"), "Time compressing "
       "and decompressing gradients.", "comm"),
    _m("traind_comm_allreduce_seconds", "counter", "seconds", (*RRM, "method"), "Time "
       "the mesh dimension's collectives were in flight (the union of their intervals, by "
       "host clock on CPU and CUDA events on GPUs; per rank: a straggler waits least): dp's "
       "gradient collectives, tp's DTensor ones (method none).", "comm"),
    _m("traind_comm_buckets", "counter", "", (*RRM, "method"), "Gradient buckets "
       "communicated.", "comm"),
    _m("traind_comm_collective_calls", "counter", "", (*RRM, "op", "size"), "Collectives "
       "this rank ran on the training path, by mesh dimension, op and message-size bucket "
       "(upper bound): the DDP hook's (dp) and those DTensor issues in forward and backward "
       "(tp, counted on report steps and scaled by the steps they stand for).", "comm"),
    _m("traind_comm_collective_bytes", "counter", "bytes", (*RRM, "op", "size"), "Message "
       "bytes this rank handed to those collectives, not bytes on the wire: the input "
       "tensors' size (an all-gather's is this rank's part), measured on every step for dp, "
       "on report steps and scaled as the calls are for tp.", "comm"),
    _m("traind_comm_collective_latency_seconds", "histogram", "seconds", (*RRM, "op", "size"),
       "Latency of one collective, start to completion as this rank saw it (CUDA events on "
       "GPUs, read at the report's sync point).", "comm", buckets=LATENCY_BOUNDS),
    _m("traind_comm_collective_bus_bandwidth_bytes_per_second", "gauge", "bytes", (*RRM, "op",
       "size"), "Bus bandwidth of the last window's collectives (nccl-tests size / seconds x "
       "the nccl-tests factor of the op; an all-gather's size is its output).", "comm"),
    _m("traind_comm_collective_algorithm_bandwidth_bytes_per_second", "gauge", "bytes",
       (*RRM, "op", "size"), "Algorithm bandwidth of the last window's collectives "
       "(nccl-tests size / seconds).", "comm"),
    _m("traind_ddp_seconds", "gauge", "seconds", (*RRM, "phase"), "DDP's own timing of its "
       "last sampled iteration: forward_compute, backward_compute, backward_comm and "
       "backward_overlap (communication hidden under backward compute).", "comm"),
    _m("traind_ddp_overlap_ratio", "gauge", "ratio", RRM, "Share of DDP's backward "
       "communication overlapped with backward compute in its last sampled iteration.",
       "comm"),
    _m("traind_comm_probe_latency_seconds", "gauge", "seconds", (*RRM, "op", "size_bytes"),
       "Median time of one collective of this size in the last probe.", "comm"),
    _m("traind_comm_probe_bus_bandwidth_bytes_per_second", "gauge", "bytes", (*RRM, "op",
       "size_bytes"), "Bus bandwidth of the probe's collective (nccl-tests factors).", "comm"),
    # -- links (the probe at job start, trainer/linkprobe.py; rank 0's matrix) ------------
    _m("traind_link_latency_seconds", "gauge", "seconds", ("run", "src", "dst"), "One-way "
       "latency from rank src to rank dst: half an 8-byte ping-pong's fastest round trip, "
       "measured at job start.", "training"),
    _m("traind_link_bandwidth_bytes_per_second", "gauge", "bytes", ("run", "src", "dst"),
       "Point-to-point bandwidth from rank src to rank dst: a 1 MiB send until its "
       "acknowledgement, less one latency, the fastest of three, measured at job start.",
       "training"),
    _m("traind_link_probe_duration_seconds", "gauge", "seconds", ("run",), "Wall time of the "
       "link probe on rank 0 (every pair, both directions, and the all-gather).", "training"),
    # -- data pipeline (from worker events, every rank) ------------------------------------
    _m("traind_data_cache_hits", "counter", "", (*RR, "tier"), "Corpus documents found in "
       "a cache tier (memory, disk).", "data"),
    _m("traind_data_cache_misses", "counter", "", (*RR, "tier"), "Corpus documents a cache "
       "tier did not hold (read from the next tier or the file).", "data"),
    _m("traind_data_cache_write_errors", "counter", "", RR, "Disk-cache writes that failed "
       "(training carries on without the entry).", "data"),
    _m("traind_data_filtered_documents", "counter", "", (*RR, "reason"), "Documents left "
       "out of the corpus, by reason (empty, binary, too_short, duplicate; prepared shards "
       "add near_duplicate, low_entropy, repetitive, non_text).", "data"),
    _m("traind_data_filtered_bytes", "counter", "bytes", (*RR, "reason"), "Bytes of the "
       "documents each filter removed (prepared shards' report; never tokenized).", "data"),
    _m("traind_data_filtered_tokens", "counter", "", (*RR, "reason"), "Tokens the documents "
       "each filter removed would have been (prepared shards' report), estimated: their "
       "bytes x the kept documents' tokens per byte (exact for the bytes tokenizer).",
       "data"),
    _m("traind_data_tokens", "gauge", "", RR, "Tokens the run trains and validates on.",
       "data"),
    _m("traind_data_tier_hits", "counter", "", (*RR, "tier"), "Batches a data cache tier "
       "held when asked: device (CUDA: copied ahead), host (the ring drawn ahead), "
       "page_cache (read with no major page fault).", "data"),
    _m("traind_data_tier_misses", "counter", "", (*RR, "tier"), "Batches a data cache tier "
       "did not hold (drawn, copied or read from disk on demand).", "data"),
    _m("traind_data_tier_wait_seconds", "counter", "seconds", (*RR, "tier"), "Time spent on "
       "the batches a data cache tier missed.", "data"),
    _m("traind_data_documents", "gauge", "", RR, "Documents in the corpus.", "data"),
    _m("traind_data_corpus_bytes", "gauge", "bytes", RR, "Corpus size after filtering.",
       "data"),
    _m("traind_data_batches", "counter", "", RR, "Batches the pipeline handed to the loop.",
       "data"),
    _m("traind_data_prefetch_depth", "gauge", "", RR, "Batches ready in the prefetch queue "
       "when the loop last asked (0 = the loop waits for data).", "data"),
    _m("traind_data_prefetch_depth_mean", "gauge", "", RR, "Mean prefetch queue depth at "
       "the loop's requests since the run started.", "data"),
    _m("traind_data_prefetch_capacity", "gauge", "", RR, "Prefetch queue size (data."
       "prefetch; 0 = synchronous).", "data"),
    _m("traind_data_wait_seconds", "counter", "seconds", RR, "Time the loop waited for "
       "batches.", "data"),
    # -- host and processes (psutil, read at scrape time) -------------------------------------
    _m("traind_host_cpu_seconds", "counter", "seconds", ("mode",), "CPU time by mode, all "
       "cores.", "host"),
    _m("traind_host_cpu_core_seconds", "counter", "seconds", ("core", "mode"), "CPU time by "
       "core and mode.", "host"),
    _m("traind_host_cpu_usage_ratio", "gauge", "ratio", (), "CPU busy share over the last "
       "window of at least 1 s, all cores (the collector's own baseline).", "host"),
    _m("traind_host_cpus", "gauge", "", (), "Logical CPUs.", "host"),
    _m("traind_host_usable_cpus", "gauge", "", (), "CPUs the daemon's processes may use: "
       "the affinity mask capped by the cgroup CPU quota (what ranks size their threads by).",
       "host"),
    _m("traind_host_runnable_threads", "gauge", "", (), "Threads running or waiting for a "
       "CPU on the host now (/proc/stat procs_running, less the collector's own).", "host"),
    _m("traind_host_oversubscribed", "gauge", "", (), "1 when more threads are runnable "
       "than there are usable CPUs (threads wait for a turn), else 0.", "host"),
    _m("traind_host_memory_total_bytes", "gauge", "bytes", (), "Physical memory.", "host"),
    _m("traind_host_memory_available_bytes", "gauge", "bytes", (), "Memory available without "
       "swapping.", "host"),
    _m("traind_host_memory_used_bytes", "gauge", "bytes", (), "Memory used.", "host"),
    _m("traind_host_swap_used_bytes", "gauge", "bytes", (), "Swap used.", "host"),
    _m("traind_host_swap_total_bytes", "gauge", "bytes", (), "Swap size.", "host"),
    _m("traind_host_load", "gauge", "", ("window",), "Load average.", "host"),
    _m("traind_host_disk_read_bytes", "counter", "bytes", ("device",), "Bytes read.", "host"),
    _m("traind_host_disk_written_bytes", "counter", "bytes", ("device",), "Bytes written.",
       "host"),
    _m("traind_host_disk_reads", "counter", "", ("device",), "Read operations.", "host"),
    _m("traind_host_disk_writes", "counter", "", ("device",), "Write operations.", "host"),
    _m("traind_host_network_received_bytes", "counter", "bytes", ("interface",), "Bytes "
       "received.", "host"),
    _m("traind_host_network_sent_bytes", "counter", "bytes", ("interface",), "Bytes sent.",
       "host"),
    _m("traind_host_network_errors", "counter", "", ("interface", "direction"), "Receive and "
       "transmit errors.", "host"),
    _m("traind_host_collector_success", "gauge", "", (), "1 if the host collector read "
       "everything, else 0.", "host"),
    _m("traind_host_collector_duration_seconds", "gauge", "seconds", (), "Time the host "
       "collector took.", "host"),
    _m("traind_process_cpu_seconds", "counter", "seconds", ("role", "pid"), "User and system "
       "CPU time of the daemon and each worker process.", "host"),
    _m("traind_process_resident_memory_bytes", "gauge", "bytes", ("role", "pid"), "Resident "
       "memory.", "host"),
    _m("traind_process_threads", "gauge", "", ("role", "pid"), "OS threads.", "host"),
    _m("traind_process_open_fds", "gauge", "", ("role", "pid"), "Open file descriptors.",
       "host"),
    # -- the daemon itself ----------------------------------------------------------------
    _m("traind_build", "info", "", ("version", "torch"), "Versions of traind and torch.",
       "daemon"),
    _m("traind_events_received", "counter", "", ("kind",), "Events received from workers.",
       "daemon"),
    _m("traind_events_malformed", "counter", "", (), "Lines from workers that were not "
       "events.", "daemon"),
    _m("traind_runs_finished", "counter", "", ("state",), "Runs that ended, by final state.",
       "daemon"),
    _m("traind_runs_running", "gauge", "", (), "Runs whose workers are alive.", "daemon"),
    _m("traind_node_goodput_ratio", "gauge", "ratio", (), "The node's goodput since the "
       "daemon started: its runs' productive training time over its wall time "
       "(metrics/goodput.py; runs at once each count).", "daemon"),
    _m("traind_node_productive_seconds", "gauge", "seconds", (), "Productive training time "
       "of the node's runs since the daemon started.", "daemon"),
    _m("traind_node_idle_seconds", "gauge", "seconds", (), "Time since the daemon started "
       "with no run's workers alive on the node (badput of kind idle).", "daemon"),
    _m("traind_live_messages_dropped", "gauge", "", (), "Live messages dropped from slow "
       "browsers' queues (cumulative).", "daemon"),
    _m("traind_live_subscribers", "gauge", "", (), "Browsers connected to the live "
       "websocket.", "daemon"),
    _m("traind_db_pending_events", "gauge", "", (), "Run events held for the database "
       "(in memory or spilled under var/): above 0 for long, the database refuses writes.",
       "daemon"),
    _m("traind_scrape_duration_seconds", "gauge", "seconds", (), "Time the previous /metrics "
       "scrape took to render.", "daemon"),
    _m("traind_scrape_series", "gauge", "", (), "Series in the previous /metrics scrape.",
       "daemon"),
)



def _unit(name: str) -> str:
    for suffix, unit in (("_seconds", "seconds"), ("_bytes", "bytes"), ("_ratio", "ratio"),
                         ("_watts", "watts"), ("_joules", "joules"), ("_hertz", "hertz"),
                         ("_celsius", "celsius"), ("_bytes_per_second", "bytes")):
        if name.endswith(suffix):
            return unit
    return ""


def _gpu_specs() -> tuple[MetricSpec, ...]:
    """The GPU families, declared beside the pure function that shapes them
    (metrics/gpu_shape.py) and listed here like every other family."""
    from traind.metrics.gpu_shape import GPU_FAMILIES, LINK_FAMILIES, PREFIX

    specs = [
        _m(PREFIX + "info", "gauge", "", ("gpu", "uuid", "name", "pci_bus_id", "node"),
           "GPU identity (value 1); join on gpu for names.", "gpu", gpu_only=True),
        _m(PREFIX + "devices", "gauge", "", (), "NVIDIA GPUs NVML reports (0 without).",
           "gpu"),
        _m(PREFIX + "collector_success", "gauge", "", (), "1 if the GPU collector read "
           "everything, else 0.", "gpu"),
        _m(PREFIX + "collector_duration_seconds", "gauge", "seconds", (), "Time the GPU "
           "collector took.", "gpu"),
        _m(PREFIX + "collector_unsupported_fields", "gauge", "", (), "NVML queries this GPU "
           "and driver do not support (skipped series).", "gpu", gpu_only=True),
    ]
    for table, extra, switch in ((GPU_FAMILIES, (), ""),
                                 (LINK_FAMILIES, ("link",), "metrics.per_link")):
        for key, fam in table.items():
            name = PREFIX + key
            specs.append(_m(name, "counter" if fam.counter else "gauge", _unit(name),
                            ("gpu", *extra, *fam.labels), fam.help, "gpu", gpu_only=True,
                            switch=switch))
    return tuple(specs)


CATALOG = (*CATALOG, *_gpu_specs())
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}


def spec(name: str) -> MetricSpec:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in metrics/catalog.py: declare it there first") from None


def build(registry: CollectorRegistry, name: str) -> Gauge | Counter | Histogram | Info:
    """A prometheus_client metric for the catalog entry ``name``, in ``registry``."""
    m = spec(name)
    if m.kind == "gauge":
        return Gauge(m.name, m.help, m.labels, registry=registry)
    if m.kind == "counter":
        return Counter(m.name, m.help, m.labels, registry=registry)
    if m.kind == "histogram":
        return Histogram(m.name, m.help, m.labels, buckets=m.buckets, registry=registry)
    return Info(m.name.removesuffix("_info"), m.help, registry=registry)


def gauge(registry: CollectorRegistry, name: str) -> Gauge:
    m = build(registry, name)
    assert isinstance(m, Gauge), f"{name} is not a gauge in the catalog"
    return m


def counter(registry: CollectorRegistry, name: str) -> Counter:
    m = build(registry, name)
    assert isinstance(m, Counter), f"{name} is not a counter in the catalog"
    return m


def histogram(registry: CollectorRegistry, name: str) -> Histogram:
    m = build(registry, name)
    assert isinstance(m, Histogram), f"{name} is not a histogram in the catalog"
    return m


def info(registry: CollectorRegistry, name: str) -> Info:
    m = build(registry, name)
    assert isinstance(m, Info), f"{name} is not an info in the catalog"
    return m


def family(name: str, value: float | None = None) -> GaugeMetricFamily | CounterMetricFamily:
    """A metric family for a custom collector (read at scrape time), from the catalog."""
    m = spec(name)
    if m.kind == "counter":
        return CounterMetricFamily(m.name, m.help, labels=m.labels or None, value=value)
    return GaugeMetricFamily(m.name, m.help, labels=m.labels or None, value=value)


def markdown() -> str:
    """docs/metrics.md: one table row per family, grouped by source."""
    lines = ["# traind metrics", "",
             "Generated from `metrics/catalog.py` (`traind metrics docs`); do not edit.", ""]
    for source in dict.fromkeys(m.source for m in CATALOG):
        lines += [f"## {source}", "", "| name | type | unit | labels | help |",
                  "| --- | --- | --- | --- | --- |"]
        for m in (m for m in CATALOG if m.source == source):
            flags = " (GPU only)" if m.gpu_only else ""
            flags += f" (off with `{m.switch}`)" if m.switch else ""
            lines.append(f"| `{m.exposed}` | {m.kind} | {m.unit or '-'} | "
                         f"{', '.join(m.labels) or '-'} | {m.help}{flags} |")
        lines.append("")
    return "\n".join(lines)
