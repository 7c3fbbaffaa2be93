"""Frozen messages a worker sends to the daemon.

Workers never touch the database or the Prometheus registry: they send these small immutable
records, one JSON object per line, each with a schema version ``v`` and a ``kind``. The daemon
decodes them with :func:`decode` and is the single writer of everything downstream.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One optimizer step on one rank. Times are seconds of wall clock on that rank."""

    kind: ClassVar[str] = "step"
    rank: int
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens processed by this rank in this step
    step_seconds: float
    data_seconds: float
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    dropped_events: int = 0  # events this rank's sink could not queue so far (cumulative)
    steps: int = 1  # optimizer steps since this rank's previous step event (telemetry.every)
    skipped_steps: int = 0  # of those, steps the fp16 scaler skipped (inf/NaN gradients)
    loss_scale: float = 1.0  # fp16 GradScaler scale after this step (1 without a scaler)
    nonfinite: bool = False  # the reported loss was NaN or infinite
    cuda_memory: dict[str, float] = field(default_factory=dict)  # allocator stats (CUDA only)
    time: float = 0.0  # unix time at the end of the step
    # The worker's ledger (trainer/ledger.py): seconds per kind since its process started,
    # and "started"/"time" (unix). Empty from a sender that keeps none.
    clock: dict[str, float] = field(default_factory=dict)
    # When this rank's first gradient bucket of the step reached the collectives, unix time on
    # rank 0's clock (trainer/clocksync.py); 0: not measured (one rank, no DDP hook).
    arrival: float = 0.0


@dataclass(frozen=True, slots=True)
class EvalEvent:
    """Validation loss over ``batches`` held-out batches at ``step``."""

    kind: ClassVar[str] = "eval"
    rank: int
    step: int
    val_loss: float
    batches: int
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """Job phases: ``started`` (with the first step and totals), ``checkpoint``, ``finished``."""

    kind: ClassVar[str] = "lifecycle"
    rank: int
    phase: str  # started | checkpoint | resumed | finished
    step: int
    detail: dict[str, Any] = field(default_factory=dict)  # small, JSON-serializable
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class CommEvent:
    """Gradient communication of one rank over ``steps`` optimizer steps (summed), as seen by
    the compression hook: bytes before and after compression, what compression lost, and
    where the time went."""

    kind: ClassVar[str] = "comm"
    rank: int
    step: int
    method: str  # compression method name
    steps: int  # optimizer steps covered
    buckets: int  # hook calls (gradient buckets) covered
    raw_bytes: int  # gradient bytes before compression
    sent_bytes: int  # wire bytes, modelled: ring formulas on the bytes handed to collectives
    rel_error: float  # ||g_hat - g|| / ||g|| over the covered steps (0 for lossless)
    hook_seconds: float  # compress + decompress time, collectives excluded
    allreduce_seconds: float  # time waiting in collectives
    # Per (op, size bucket): {"op", "size", "calls", "bytes", "seconds", "counts"}, counts per
    # latency bucket of traind.contracts.comm.LATENCY_BOUNDS (+Inf last).
    collectives: list[dict[str, Any]] = field(default_factory=list)
    # DDP's own timing of its last sampled iteration, seconds: forward_compute,
    # backward_compute, backward_comm, backward_overlap (empty before DDP has sampled one).
    ddp: dict[str, float] = field(default_factory=dict)
    world_size: int = 0  # ranks in the collectives' group (the bus-bandwidth factors)
    # The mesh dimension whose group ran these collectives (contracts.mesh.MESH_DIMS): "dp"
    # for the DDP hook's (the fields above from ``method`` to ``ddp`` are the hook's; a "tp"
    # event counts DTensor's collectives and leaves them zero). Default: older producers'.
    mesh_dim: str = "dp"
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class PrecisionEvent:
    """A parameter group switched compute precision (adaptive policy), or the fp16 scaler
    skipped a step. ``snr`` is the group's gradient signal-to-noise ratio when it switched."""

    kind: ClassVar[str] = "precision"
    rank: int
    step: int
    group: str  # parameter group: "embed", "block.0", ..., "head"
    before: str  # fp32 | bf16 | fp16
    after: str
    snr: float
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class SNREvent:
    """Adaptive precision at a telemetry report: each measured group's gradient SNR over the
    last complete window (the one that closed at ``window_step``) and the precision it computes
    in now. Lists are parallel to ``groups``; every rank sends the same figures (DDP's
    gradients are all-reduced, FSDP's sums are)."""

    kind: ClassVar[str] = "snr"
    rank: int
    step: int
    window_step: int
    groups: list[str]  # "block.0", ..., "head" (the embedding is pinned to fp32, unmeasured)
    snr: list[float]  # trainer.precision.snr_from_moments: mean² / var of the gradient norm
    modes: list[str]  # fp32 | bf16 | fp16
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class LayerEvent:
    """Per-layer norms at one step (rank 0: after the all-reduce every rank holds the same
    gradients). Lists are parallel to ``layers``; update_ratio = ||W_after - W_before|| / ||W||."""

    kind: ClassVar[str] = "layers"
    rank: int
    step: int
    layers: list[str]
    grad_norm: list[float]
    weight_norm: list[float]
    update_ratio: list[float]
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class ProbeEvent:
    """A bounded all-reduce probe between steps: median seconds per message size, and the
    bus bandwidth that implies (nccl-tests factor 2(n-1)/n)."""

    kind: ClassVar[str] = "probe"
    rank: int
    step: int
    op: str  # all_reduce
    world_size: int
    sizes: list[int]  # bytes
    seconds: list[float]  # median over the probe's repeats, per size
    mesh_dim: str = "dp"  # the group probed: "dp" when the world is all dp, else "world"
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkEvent:
    """The link probe at job start (trainer/linkprobe.py): each pair's one-way latency and
    bandwidth, ``[src][dst]`` by rank (0 on the diagonal), and the placement it led to. Rank
    0 sends it: every rank holds the same all-gathered matrix."""

    kind: ClassVar[str] = "link"
    rank: int
    step: int
    latency: list[list[float]]  # seconds: half an 8-byte ping-pong's fastest round trip
    bandwidth: list[list[float]]  # bytes/s of a bandwidth_bytes send, acknowledged
    latency_bytes: int  # the ping's message size
    bandwidth_bytes: int  # the bandwidth message's size
    seconds: float  # the probe's wall time on the sending rank
    placement: str  # parallel.placement: fixed | auto
    order: list[int]  # the ranks in mesh-slot order ((pp, dp, tp) row-major); identity: fixed
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class PipelineEvent:
    """One pipeline-parallel step on one stage (a report step's): how long the stage computed
    and waited, in host seconds, and the bubble it measured beside the schedule's theory."""

    kind: ClassVar[str] = "pipeline"
    rank: int
    step: int
    stage: int  # 0 .. stages - 1
    stages: int  # parallel.pp
    microbatches: int  # parallel.microbatches
    schedule: str  # parallel.pp_schedule
    busy_seconds: float  # forward and backward chunks (and the loss on the last stage)
    idle_seconds: float  # the rest of the schedule's step: waiting on the neighbours
    bubble: float  # idle / step, measured
    bubble_theory: float  # (p - 1) / (m + p - 1)
    # Activation traffic at this stage's boundaries in the step, per (direction, op):
    # {"direction": "forward" (activations) | "backward" (their gradients), "op": "send" |
    # "recv", "calls", "bytes", "seconds"}: the tensors the schedule's P2P ops carry, and the
    # host time it blocked waiting on them (trainer/pipeline_p2p.py; absent: not timed).
    p2p: list[dict[str, Any]] = field(default_factory=list)
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class ArmEvent:
    """One block of an interleaved A/B run on one rank: what the arm did after warm-up."""

    kind: ClassVar[str] = "arm"
    rank: int
    step: int  # the block's last step
    arm: str
    block: int
    steps: int  # measured steps (the block's, less warm-up)
    tokens: int  # this rank's tokens in the measured steps
    seconds: float  # wall time of the measured steps
    loss: float  # mean training loss over the block's reported steps (nan if none)
    # ||g_hat - g|| / ||g|| of the block's compressed gradients (0: lossless; nan: non-finite)
    grad_error: float = 0.0
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class DataEvent:
    """One rank's data pipeline, cumulative since the run started (the fields of
    :class:`traind.trainer.pipeline.DataStats`): corpus filters and cache tiers once built,
    batches, prefetch queue depth and the time the loop waited for data as it trains."""

    kind: ClassVar[str] = "data"
    rank: int
    step: int
    cache_hits: dict[str, int]  # per tier: memory, disk
    cache_misses: dict[str, int]
    cache_write_errors: int
    filtered: dict[str, int]  # documents dropped, per reason
    documents_kept: int
    bytes_kept: int
    batches_served: int
    prefetch_capacity: int
    prefetch_depth_mean: float
    prefetch_depth_last: int
    prefetch_wait_seconds: float
    tokens_kept: int = 0  # train and validation tokens
    filtered_bytes: dict[str, int] = field(default_factory=dict)  # per reason (prepared data)
    filtered_tokens: dict[str, int] = field(default_factory=dict)  # per reason (prepared data)
    tier_hits: dict[str, int] = field(default_factory=dict)  # per cache tier: device, host,
    tier_misses: dict[str, int] = field(default_factory=dict)  # page_cache (trainer/tiers.py)
    tier_wait_seconds: dict[str, float] = field(default_factory=dict)
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class NumericsEvent:
    """The numerics policy acted at ``step`` (trainer/numerics.py); every rank sends one, all
    for the same step and action."""

    kind: ClassVar[str] = "numerics"
    rank: int
    step: int
    action: str  # fail | skip_step | rollback
    reason: str  # nonfinite_loss | nonfinite_grad | loss_spike
    value: float  # the loss (averaged over ranks) or gradient norm that tripped the check
    limit: float = float("nan")  # loss_spike: the loss the window allowed
    resume_step: int = -1  # rollback: the checkpoint's step training continues from
    skipped_batches: int = 0  # rollback: steps' worth of batches left out (the offending too)
    time: float = 0.0


Event = (StepEvent | EvalEvent | LifecycleEvent | CommEvent | PrecisionEvent | LayerEvent
         | ProbeEvent | ArmEvent | DataEvent | NumericsEvent | SNREvent | PipelineEvent
         | LinkEvent)
_KINDS: dict[str, type[Event]] = {
    cls.kind: cls for cls in (StepEvent, EvalEvent, LifecycleEvent, CommEvent, PrecisionEvent,
                              LayerEvent, ProbeEvent, ArmEvent, DataEvent, NumericsEvent,
                              SNREvent, PipelineEvent, LinkEvent)
}


def encode(event: Event) -> bytes:
    """One event as a JSON line."""
    body = dataclasses.asdict(event)
    body["v"] = SCHEMA_VERSION
    body["kind"] = event.kind
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes | str) -> Event:
    """The event in one JSON line; ``ValueError`` for anything that is not a known event."""
    try:
        body = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"event is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("event is not a JSON object")
    if body.pop("v", None) != SCHEMA_VERSION:
        raise ValueError(f"event schema version is not {SCHEMA_VERSION}")
    cls = _KINDS.get(body.pop("kind", None))
    if cls is None:
        raise ValueError("event kind is unknown")
    try:
        return cls(**body)
    except TypeError as exc:
        raise ValueError(f"event fields do not match {cls.__name__}: {exc}") from None


def decode_complete(data: bytes) -> list[Event]:
    """The events in a file's bytes, up to its last newline: a file another process is still
    appending to may end in a line it has only half written, which is not yet an event."""
    complete = data[: data.rfind(b"\n") + 1]
    return [decode(line) for line in complete.splitlines() if line]
