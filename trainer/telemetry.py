"""What the training loop tells the daemon about its steps: one builder per kind of event.

The loop decides when (report steps, layer steps, probe steps, block ends); this module turns
what a step left behind into events and sends them to the sink. Host-device syncs happen only
in :meth:`Telemetry.step` (loss and grad norm, read on report steps) and in the collectives a
probe runs (DESIGN.md's hot-path rule); nothing here runs on the other steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING

from traind.contracts.events import (
    ArmEvent,
    CommEvent,
    DataEvent,
    LayerEvent,
    PipelineEvent,
    PrecisionEvent,
    ProbeEvent,
    SNREvent,
    StepEvent,
)
from traind.trainer.device import allocator_stats
from traind.trainer.dtensors import whole
from traind.trainer.parallel import ddp_timing
from traind.trainer.pipeline_parallel import measured_bubble, theoretical_bubble
from traind.trainer.precision import AdaptivePolicy
from traind.trainer.probe import all_reduce_probe

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import nn

    from traind.contracts.events import Event
    from traind.trainer.compression import CompressionHook
    from traind.trainer.config import TelemetryConfig
    from traind.trainer.distributed import DistInfo
    from traind.trainer.interleave import BlockResult
    from traind.trainer.layers import LayerStats
    from traind.trainer.ledger import Ledger
    from traind.trainer.pipeline import DataPipeline
    from traind.trainer.pipeline_parallel import Pipeline
    from traind.trainer.precision import PrecisionPolicy, Switch
    from traind.trainer.sink import EventSink
    from traind.trainer.tp_comm import MeshCollectives


class Telemetry:
    """One rank's events, stamped and sent to ``sink``. Keeps what a report counts from: the
    step of the last report and the skipped steps the policy had counted by then."""

    def __init__(self, sink: EventSink, info: DistInfo, cfg: TelemetryConfig,
                 device: torch.device) -> None:
        self.sink, self.info, self.cfg, self.device = sink, info, cfg, device
        self.reported_at = 0  # a report's ``steps`` are those since this one
        self.skipped_at_report = 0  # the policy's ``skipped`` at that report
        # the probe's group, all ranks: dp where the world is all dp, else "world" (the
        # loop sets it once the mesh is known)
        self.probe_dim = "dp"

    def emit(self, event: Event) -> None:
        """Send ``event``, stamped with the wall clock if it has no time yet."""
        if not event.time:
            event = dataclasses.replace(event, time=time.time())
        self.sink.emit(event)

    def count_from(self, step: int, skipped: int) -> None:
        """The next report counts steps after ``step`` and skips beyond ``skipped`` (at the
        start of a call, and after a rollback sets the step back)."""
        self.reported_at, self.skipped_at_report = step, skipped

    def step(self, step: int, *, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor,
             phases: dict[str, float], policy: PrecisionPolicy, tokens: int,
             data: DataPipeline, ledger: Ledger | None = None, arrival: float = 0.0
             ) -> float:
        """A report step's StepEvent (with the worker's ledger, when given) and DataEvent;
        the loss read on the host (the two ``item()`` calls are the only host-device syncs
        telemetry adds)."""
        loss_value = loss.item()
        stats = data.stats()
        self.emit(StepEvent(
            rank=self.info.rank, step=step, loss=loss_value, lr=lr,
            grad_norm=whole(grad_norm).item(), tokens=tokens,
            step_seconds=phases["total"], data_seconds=phases["data"],
            forward_seconds=phases["forward"], backward_seconds=phases["backward"],
            optimizer_seconds=phases["optimizer"], dropped_events=self.sink.dropped,
            steps=step - self.reported_at, skipped_steps=policy.skipped - self.skipped_at_report,
            loss_scale=policy.loss_scale, nonfinite=not math.isfinite(loss_value),
            cuda_memory=allocator_stats(self.device), time=time.time(),
            clock=ledger.snapshot(stats.prefetch_wait_seconds) if ledger is not None else {},
            arrival=arrival,
        ))
        self.count_from(step, policy.skipped)
        self.emit(DataEvent(rank=self.info.rank, step=step, **dataclasses.asdict(stats)))
        return loss_value

    def comm(self, step: int, hook: CompressionHook, module: nn.Module) -> None:
        """The hook's window since the last report, as one event (and a fresh window)."""
        stats = hook.take_stats()
        ddp = module._get_ddp_logging_data()  # type: ignore[operator]
        self.emit(CommEvent(rank=self.info.rank, step=step, method=hook.method,
                            **{**dataclasses.asdict(stats),
                               "collectives": list(stats.collectives)},
                            ddp=ddp_timing(ddp), world_size=hook.world))

    def mesh_comm(self, step: int, counted: MeshCollectives) -> None:
        """The collectives counted on this step (tensor parallel's), one event per mesh
        dimension, standing for the steps since the last count (trainer/tp_comm.py says why
        that is exact in calls and bytes). No hook: its fields stay zero. On CUDA, reading
        the collectives' events waits for them: once in ``telemetry.layer_every`` steps, as
        the per-layer norms do."""
        steps = max(1, step - counted.counted_at)  # a rollback's step goes back: one
        counted.counted_at = step
        for dim, (window, busy) in counted.take(steps).items():
            self.emit(CommEvent(rank=self.info.rank, step=step, method="none", steps=steps,
                                buckets=0, raw_bytes=0, sent_bytes=0, rel_error=0.0,
                                hook_seconds=0.0, allreduce_seconds=busy, collectives=window,
                                world_size=counted.sizes.get(dim, 0), mesh_dim=dim))

    def pipeline(self, step: int, pipe: Pipeline) -> None:
        """A report step's pipeline figures for this rank's stage (host times, no sync)."""
        t = pipe.last_timing
        self.emit(PipelineEvent(rank=self.info.rank, step=step, stage=pipe.stage,
                                stages=pipe.stages, microbatches=pipe.microbatches,
                                schedule=pipe.schedule_name, busy_seconds=t.busy,
                                idle_seconds=t.idle, bubble=measured_bubble(t.busy, t.wall),
                                bubble_theory=theoretical_bubble(
                                    pipe.stages, pipe.microbatches, pipe.virtual),
                                p2p=pipe.last_p2p))

    def layers(self, step: int, layers: LayerStats) -> None:
        """Per-layer norms after the optimizer step; every rank reads them, rank 0 sends."""
        grads, weights, ratios = layers.after_step()
        if self.info.rank == 0:
            self.emit(LayerEvent(rank=0, step=step, layers=layers.names, grad_norm=grads,
                                 weight_norm=weights, update_ratio=ratios))

    def probe(self, step: int) -> None:
        """All-reduce latency per message size, every ``telemetry.probe_every`` steps of a
        job with several ranks (a collective: every rank probes on the same steps)."""
        every = self.cfg.probe_every
        if not (every and self.info.world_size > 1 and step % every == 0):
            return
        sizes = self.cfg.probe_sizes
        latency = all_reduce_probe(sizes, self.cfg.probe_repeats, self.device)
        self.emit(ProbeEvent(rank=self.info.rank, step=step, op="all_reduce",
                             world_size=self.info.world_size, sizes=sizes, seconds=latency,
                             mesh_dim=self.probe_dim))

    def block(self, step: int, block: BlockResult, grad_error: float) -> None:
        """An A/B block ended: its arm's steps, time, tokens, loss and compression error."""
        self.emit(ArmEvent(rank=self.info.rank, step=step, arm=block.arm, block=block.block,
                           steps=block.steps, tokens=block.tokens, seconds=block.seconds,
                           loss=block.loss, grad_error=grad_error))

    def precision(self, step: int, switches: Iterable[Switch], policy: PrecisionPolicy, *,
                  report: bool) -> None:
        """The precision switches the policy made at this step, and on report steps every
        adaptive group's SNR (the switches are only the changes)."""
        for switch in switches:
            self.emit(PrecisionEvent(rank=self.info.rank, step=step, group=switch.group,
                                     before=switch.before, after=switch.after,
                                     snr=switch.snr))
        if report and isinstance(policy, AdaptivePolicy) and (snrs := policy.last_snr()):
            modes = policy.modes()
            self.emit(SNREvent(rank=self.info.rank, step=step, window_step=policy.snr_step,
                               groups=list(snrs), snr=list(snrs.values()),
                               modes=[modes[g] for g in snrs]))
