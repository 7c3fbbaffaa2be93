from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from traind.contracts.events import DataEvent, EvalEvent, LifecycleEvent, StepEvent
from traind.metrics.training import TrainingMetrics


def step(n: int, *, steps: int = 1, rank: int = 0) -> StepEvent:
    return StepEvent(rank=rank, step=n, loss=2.0, lr=1e-3, grad_norm=0.5, tokens=100,
                     step_seconds=0.1, data_seconds=0.01, forward_seconds=0.03,
                     backward_seconds=0.05, optimizer_seconds=0.01, steps=steps)


def test_each_registry_is_its_own():
    a, b = CollectorRegistry(), CollectorRegistry()
    TrainingMetrics(a)
    TrainingMetrics(b)  # no duplicate-series error: nothing is global


def test_step_eval_and_checkpoint_events_set_the_series():
    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    m.observe(7, step(5, steps=5))
    m.observe(7, step(5, steps=5, rank=1))
    m.observe(7, EvalEvent(rank=0, step=5, val_loss=2.5, batches=2))
    m.observe(7, LifecycleEvent(rank=0, phase="checkpoint", step=5, detail={"seconds": 0.2}))
    m.observe(7, LifecycleEvent(rank=0, phase="started", step=0,
                                detail={"params": 1234, "flops_per_token": 9e3}))
    lab = {"run": "7", "rank": "0"}
    get = reg.get_sample_value
    assert get("traind_train_loss", lab) == 2.0
    # Counters count the steps between telemetry reports too.
    assert get("traind_train_tokens_total", lab) == 500
    assert get("traind_train_steps_total", lab) == 5
    assert get("traind_train_tokens_per_second", lab) == 1000
    assert get("traind_validation_loss", lab) == 2.5
    assert get("traind_checkpoints_total", lab) == 1
    assert get("traind_model_parameters", {"run": "7"}) == 1234
    assert get("traind_step_phase_duration_seconds_count", {**lab, "phase": "backward"}) == 1
    assert get("traind_train_loss", {"run": "7", "rank": "1"}) == 2.0


def test_comm_and_precision_events():
    from traind.contracts.events import CommEvent, PrecisionEvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    m.observe(1, LifecycleEvent(rank=0, phase="started", step=0,
                                detail={"precision_modes": {"block.0": "fp32"}}))
    m.observe(1, CommEvent(rank=0, step=2, method="int8", steps=2, buckets=4, raw_bytes=4000,
                           sent_bytes=1000, rel_error=0.01, hook_seconds=0.2,
                           allreduce_seconds=0.3, world_size=4))
    m.observe(1, PrecisionEvent(rank=0, step=8, group="block.0", before="fp32", after="bf16",
                                snr=5.0))
    get = reg.get_sample_value
    c = {"run": "1", "rank": "0", "mesh_dim": "dp", "method": "int8"}
    assert get("traind_comm_gradient_bytes_total", c) == 4000
    assert get("traind_comm_sent_bytes_total", c) == 1000
    # fp32's all-reduce would send 4000 x 2(4-1)/4 = 6000 modelled wire bytes
    assert get("traind_comm_compression_ratio", c) == 6.0
    assert get("traind_comm_compression_error_ratio", c) == 0.01
    assert get("traind_comm_buckets_total", c) == 4
    g = {"run": "1", "rank": "0", "group": "block.0"}
    assert get("traind_precision_mode", {**g, "mode": "bf16"}) == 1.0
    assert get("traind_precision_mode", {**g, "mode": "fp32"}) == 0.0
    assert get("traind_precision_switches_total", {**g, "mode": "bf16"}) == 1
    assert get("traind_precision_gradient_snr", g) == 5.0


def test_snr_events_set_every_groups_snr_and_mode():
    from traind.contracts.events import SNREvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    for step, snrs, modes in ((16, [3.0, 9.5], ["fp32", "fp32"]),
                              (32, [2.5, 12.0], ["fp32", "bf16"])):
        m.observe(4, SNREvent(rank=1, step=step, window_step=step, groups=["block.0", "head"],
                              snr=snrs, modes=modes))
    get = reg.get_sample_value
    b0 = {"run": "4", "rank": "1", "group": "block.0"}
    head = {**b0, "group": "head"}
    assert (get("traind_precision_gradient_snr", b0),
            get("traind_precision_gradient_snr", head)) == (2.5, 12.0)
    assert get("traind_precision_mode", {**b0, "mode": "fp32"}) == 1.0
    assert get("traind_precision_mode", {**head, "mode": "bf16"}) == 1.0
    assert get("traind_precision_mode", {**head, "mode": "fp32"}) == 0.0


def test_layer_and_probe_events():
    from traind.contracts.events import LayerEvent, ProbeEvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    m.observe(2, LayerEvent(rank=0, step=10, layers=["embed", "block.0"], grad_norm=[1.0, 2.0],
                            weight_norm=[3.0, 4.0], update_ratio=[0.01, 0.02]))
    m.observe(2, ProbeEvent(rank=1, step=10, op="all_reduce", world_size=2, sizes=[4096],
                            seconds=[0.001]))
    get = reg.get_sample_value
    assert get("traind_layer_grad_norm", {"run": "2", "layer": "block.0"}) == 2.0
    assert get("traind_layer_update_ratio", {"run": "2", "layer": "embed"}) == 0.01
    p = {"run": "2", "rank": "1", "mesh_dim": "dp", "op": "all_reduce",
         "size_bytes": "4096"}
    assert get("traind_comm_probe_latency_seconds", p) == 0.001
    assert get("traind_comm_probe_bus_bandwidth_bytes_per_second", p) == 4096 / 0.001


def test_nonfinite_cuda_memory_and_peak_flops():
    import dataclasses

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    bad = dataclasses.replace(step(3), loss=float("nan"), nonfinite=True,
                              cuda_memory={"allocated_bytes": 5e9, "reserved_bytes": 6e9,
                                           "peak_allocated_bytes": 7e9, "alloc_retries": 2,
                                           "ooms": 0})
    m.observe(4, bad)
    m.observe(4, LifecycleEvent(rank=0, phase="started", step=0,
                                detail={"peak_flops": 989e12, "flops_per_token": 1e9}))
    get = reg.get_sample_value
    lab = {"run": "4", "rank": "0"}
    assert get("traind_train_nonfinite_steps_total", lab) == 1
    assert get("traind_cuda_memory_bytes", {**lab, "kind": "reserved"}) == 6e9
    assert get("traind_cuda_alloc_retries", lab) == 2
    assert get("traind_device_peak_flops", lab) == 989e12  # each rank's device


def test_collectives_become_a_histogram_per_op_and_size() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from traind.contracts.events import CommEvent
    from traind.trainer.collectives import CollectiveLog

    log = CollectiveLog()
    for seconds in (2e-4, 2e-4, 5e-3):
        log.record("all_reduce", 100_000, seconds)  # 64KiB < 100 kB <= 1MiB
    log.record("all_gather", 1000, 5e-5)
    window = log.take()
    assert log.take() == []  # a fresh window
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    for _ in range(2):  # two windows add up
        metrics.observe(3, CommEvent(
            rank=1, step=5, method="none", steps=5, buckets=4, raw_bytes=1, sent_bytes=1,
            rel_error=0.0, hook_seconds=0.0, allreduce_seconds=0.0, collectives=window,
            ddp={"forward_compute": 0.01, "backward_compute": 0.02, "backward_comm": 0.01,
                 "backward_overlap": 0.0025}, world_size=4))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    hist = fams["traind_comm_collective_latency_seconds"]
    ar = {s.labels["le"]: s.value for s in hist.samples
          if s.name.endswith("_bucket") and s.labels["op"] == "all_reduce"}
    assert {s.labels["size"] for s in hist.samples if s.labels["op"] == "all_reduce"} == {"1MiB"}
    assert ar["0.0001"] == 0 and ar["0.0003"] == 4 and ar["0.003"] == 4 and ar["0.01"] == 6
    assert ar["+Inf"] == 6
    count = [s.value for s in hist.samples if s.name.endswith("_count")
             and s.labels["op"] == "all_gather"]
    assert count == [2.0]
    calls = {s.labels["op"]: s.value for s in fams["traind_comm_collective_calls"].samples
             if s.name.endswith("_total")}
    assert calls == {"all_reduce": 6.0, "all_gather": 2.0}
    busbw = {s.labels["op"]: s.value for s in
             fams["traind_comm_collective_bus_bandwidth_bytes_per_second"].samples}
    mean_s = (2e-4 + 2e-4 + 5e-3) / 3
    assert busbw["all_reduce"] == pytest.approx(100_000 / mean_s * 2 * 3 / 4)
    # nccl-tests' all-gather size is its output: 4 ranks x the 1000 bytes each handed it
    assert busbw["all_gather"] == pytest.approx(4 * 1000 / 5e-5 * 3 / 4)
    overlap = fams["traind_ddp_overlap_ratio"].samples[0]
    assert overlap.value == pytest.approx(0.25) and overlap.labels["rank"] == "1"


def test_binned_histogram_refuses_counts_of_the_wrong_length() -> None:
    from traind.metrics.binned import BinnedHistogram

    hist = BinnedHistogram(CollectorRegistry(), "traind_comm_collective_latency_seconds")
    with pytest.raises(ValueError, match="counts for"):
        hist.add(("1", "0", "all_reduce", "4KiB"), [1, 2], 0.1)


def _data_event(step: int, batches: int, hits: int, wait: float) -> DataEvent:
    return DataEvent(rank=0, step=step, cache_hits={"memory": 0, "disk": hits},
                     cache_misses={"memory": 5, "disk": 5 - hits}, cache_write_errors=0,
                     filtered={"empty": 2, "binary": 1, "too_short": 0, "duplicate": 1},
                     documents_kept=5, bytes_kept=1234, batches_served=batches,
                     prefetch_capacity=2, prefetch_depth_mean=1.5, prefetch_depth_last=2,
                     prefetch_wait_seconds=wait)


def test_cumulative_data_events_become_counters_that_survive_a_restart() -> None:
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    for event in (_data_event(10, 10, 3, 0.5), _data_event(20, 20, 3, 0.75),
                  _data_event(5, 5, 5, 0.1)):  # the rank restarted: counts begin again
        metrics.observe(1, event)
    get = registry.get_sample_value
    lab = {"run": "1", "rank": "0"}
    assert get("traind_data_batches_total", lab) == 25
    assert get("traind_data_wait_seconds_total", lab) == pytest.approx(0.85)
    assert get("traind_data_cache_hits_total", {**lab, "tier": "disk"}) == 3 + 5
    assert get("traind_data_filtered_documents_total", {**lab, "reason": "empty"}) == 2 + 2
    assert get("traind_data_prefetch_depth", lab) == 2
    assert get("traind_data_corpus_bytes", lab) == 1234


def test_numerics_actions_count_by_action_and_reason() -> None:
    from traind.contracts.events import NumericsEvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    m.observe(3, NumericsEvent(rank=0, step=7, action="skip_step", reason="nonfinite_loss",
                               value=float("nan")))
    m.observe(3, NumericsEvent(rank=0, step=25, action="rollback", reason="loss_spike",
                               value=60.0, limit=4.7, resume_step=20, skipped_batches=5))
    m.observe(3, NumericsEvent(rank=0, step=28, action="rollback", reason="loss_spike",
                               value=61.0, limit=4.7, resume_step=20, skipped_batches=8))
    get = reg.get_sample_value
    lab = {"run": "3", "rank": "0"}
    assert get("traind_numerics_actions_total",
               {**lab, "action": "skip_step", "reason": "nonfinite_loss"}) == 1
    assert get("traind_numerics_actions_total",
               {**lab, "action": "rollback", "reason": "loss_spike"}) == 2
    assert get("traind_numerics_rolled_back_steps_total", lab) == 13


def test_pipeline_events_set_the_bubble_per_stage():
    from traind.contracts.events import PipelineEvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    for rank in (0, 1):
        m.observe(3, PipelineEvent(rank=rank, step=4, stage=rank, stages=2, microbatches=2,
                                   schedule="1f1b", busy_seconds=0.3 + 0.1 * rank,
                                   idle_seconds=0.7 - 0.1 * rank, bubble=0.7 - 0.1 * rank,
                                   bubble_theory=1 / 3))
    get = reg.get_sample_value
    last = {"run": "3", "rank": "1", "stage": "1"}
    assert get("traind_pipeline_bubble_ratio", last) == pytest.approx(0.6)
    assert get("traind_pipeline_bubble_ratio", {**last, "rank": "0", "stage": "0"}) == 0.7
    assert get("traind_pipeline_bubble_theoretical_ratio", last) == pytest.approx(1 / 3)
    assert get("traind_pipeline_stage_busy_seconds", last) == pytest.approx(0.4)
    assert get("traind_pipeline_stage_idle_seconds", last) == pytest.approx(0.6)


def test_a_link_event_sets_the_matrix_per_ordered_pair():
    from traind.contracts.events import LinkEvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    m.observe(5, LinkEvent(rank=0, step=0, latency=[[0.0, 2e-5], [3e-5, 0.0]],
                           bandwidth=[[0.0, 1e9], [4e8, 0.0]], latency_bytes=8,
                           bandwidth_bytes=1 << 20, seconds=0.05, placement="auto",
                           order=[0, 1]))
    get = reg.get_sample_value
    assert get("traind_link_latency_seconds", {"run": "5", "src": "0", "dst": "1"}) == 2e-5
    assert get("traind_link_latency_seconds", {"run": "5", "src": "1", "dst": "0"}) == 3e-5
    assert get("traind_link_bandwidth_bytes_per_second",
               {"run": "5", "src": "1", "dst": "0"}) == 4e8
    assert get("traind_link_bandwidth_bytes_per_second",
               {"run": "5", "src": "0", "dst": "0"}) is None  # a rank to itself: no link
    assert get("traind_link_probe_duration_seconds", {"run": "5"}) == 0.05


def test_a_tp_comm_event_carries_its_mesh_dim_and_leaves_the_hook_families_alone():
    from traind.contracts.events import CommEvent
    from traind.trainer.collectives import CollectiveLog

    log = CollectiveLog()
    log.record("all_gather", 2048, 1e-4)
    log.record("reduce_scatter", 4096, 2e-4)
    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    m.observe(5, CommEvent(rank=0, step=4, method="none", steps=4, buckets=0, raw_bytes=0,
                           sent_bytes=0, rel_error=0.0, hook_seconds=0.0,
                           allreduce_seconds=0.5, collectives=log.take(), world_size=2,
                           mesh_dim="tp"))
    get = reg.get_sample_value
    tp = {"run": "5", "rank": "0", "mesh_dim": "tp"}
    assert get("traind_comm_collective_bytes_total",
               {**tp, "op": "all_gather", "size": "4KiB"}) == 2048
    assert get("traind_comm_collective_calls_total",
               {**tp, "op": "reduce_scatter", "size": "4KiB"}) == 1
    assert get("traind_comm_allreduce_seconds_total", {**tp, "method": "none"}) == 0.5
    # the hook's figures are dp's: a tp event adds no series to them
    assert get("traind_comm_gradient_bytes_total", {**tp, "method": "none"}) is None
    assert get("traind_comm_buckets_total", {**tp, "method": "none"}) is None


def test_pipeline_p2p_traffic_per_stage_direction_and_op():
    from traind.contracts.events import PipelineEvent

    reg = CollectorRegistry()
    m = TrainingMetrics(reg)
    p2p = [{"direction": "forward", "op": "send", "calls": 2, "bytes": 8192, "seconds": 0.01},
           {"direction": "backward", "op": "recv", "calls": 2, "bytes": 8192}]  # untimed
    m.observe(3, PipelineEvent(rank=0, step=4, stage=0, stages=2, microbatches=2,
                               schedule="gpipe", busy_seconds=0.3, idle_seconds=0.7,
                               bubble=0.7, bubble_theory=1 / 3, p2p=p2p))
    get = reg.get_sample_value
    at = {"run": "3", "rank": "0", "stage": "0"}
    assert get("traind_pipeline_p2p_bytes", {**at, "direction": "forward", "op": "send"}) == 8192
    assert get("traind_pipeline_p2p_messages",
               {**at, "direction": "backward", "op": "recv"}) == 2
    assert get("traind_pipeline_p2p_bytes", {**at, "direction": "forward", "op": "recv"}) is None
    assert get("traind_pipeline_p2p_wait_seconds",
               {**at, "direction": "forward", "op": "send"}) == 0.01
    assert get("traind_pipeline_p2p_wait_seconds",
               {**at, "direction": "backward", "op": "recv"}) is None


def test_goodput_counters_rise_by_the_difference_and_never_fall():
    from traind.metrics.goodput import BADPUT, Goodput

    reg = CollectorRegistry()
    tm = TrainingMetrics(reg)

    def figures(committed: float, startup: float, lost: float) -> Goodput:
        badput = dict.fromkeys(BADPUT, 0.0) | {"startup": startup, "progress_lost": lost}
        return Goodput(wall=20.0, productive=committed + 1, committed=committed, badput=badput,
                       attempts=1)

    tm.goodput(7, figures(committed=5.0, startup=2.0, lost=0.0))
    tm.goodput(7, figures(committed=9.0, startup=2.0, lost=3.0))
    tm.goodput(7, figures(committed=8.0, startup=2.0, lost=3.0))  # a lower figure adds nothing
    get = reg.get_sample_value
    assert get("traind_goodput_seconds_total", {"run": "7"}) == 9.0
    assert get("traind_badput_seconds_total", {"run": "7", "kind": "startup"}) == 2.0
    assert get("traind_badput_seconds_total", {"run": "7", "kind": "progress_lost"}) == 3.0
    assert get("traind_goodput_ratio", {"run": "7"}) == pytest.approx(9.0 / 20.0)
    assert get("traind_effective_training_time_ratio", {"run": "7"}) == pytest.approx(15 / 20)


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_uncompressed_gradients_read_a_compression_ratio_of_1_at_any_number_of_ranks(
        world: int) -> None:
    """The ratio read N/(2(N-1)) for plain fp32 (0.67 at 4 ranks): raw over wire bytes."""
    from traind.contracts.events import CommEvent
    from traind.metrics.arithmetic import BUS_FACTORS
    from traind.metrics.training import compression_ratio

    raw = 4096
    wire = int(raw * BUS_FACTORS["all_reduce"](world))
    plain = CommEvent(rank=0, step=1, method="none", steps=1, buckets=1, raw_bytes=raw,
                      sent_bytes=wire, rel_error=0.0, hook_seconds=0.0, allreduce_seconds=0.0,
                      world_size=world)
    assert compression_ratio(plain) == pytest.approx(1.0, rel=1e-3)
    int8 = replace(plain, sent_bytes=wire // 4)  # a quarter of the bytes
    assert compression_ratio(int8) == pytest.approx(4.0, rel=1e-3)
