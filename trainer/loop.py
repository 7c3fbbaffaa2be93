"""The training loop: the one thing ``traind run`` and the daemon's workers both call.

Hot-path rules (DESIGN.md): the host reads loss and grad norm only on telemetry steps, events go
to a sink that never blocks, and phase timing on CUDA is read from events, not synchronised.
:meth:`_Run.run` is the step, top to bottom. The model it steps (precision, mesh, compile,
pipeline, dp wrap, optimizer) is :mod:`traind.trainer.stack`'s; the events it sends are built
in :mod:`traind.trainer.telemetry`, and its checkpoints, resume and rollbacks are
:mod:`traind.trainer.recovery`'s.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from traind.contracts.control import FILENAME as CONTROL_FILE
from traind.contracts.control import PROBE_REQUEST, Control, read_control
from traind.contracts.events import EvalEvent, LifecycleEvent, NumericsEvent
from traind.contracts.mesh import coordinates
from traind.trainer import distributed
from traind.trainer.clocksync import ClockSync, synchronize
from traind.trainer.compression import CompressionHook
from traind.trainer.config import SWITCHABLE_PRECISIONS, compression_unavailable
from traind.trainer.data import val_batches
from traind.trainer.device import (
    allow_tf32,
    device_name,
    device_synchronize,
    peak_flops,
    peak_memory,
)
from traind.trainer.dtensors import whole
from traind.trainer.interleave import Schedule
from traind.trainer.layers import LayerStats
from traind.trainer.ledger import Ledger
from traind.trainer.linkprobe import measure_again
from traind.trainer.mesh import dp_coordinate
from traind.trainer.numerics import Finding, NumericsError, NumericsGuard
from traind.trainer.optim import clip_grad_norm, lr_at
from traind.trainer.pipeline import DataPipeline
from traind.trainer.precision import PrecisionPolicy, build_policy
from traind.trainer.profiling import StepProfiler
from traind.trainer.recovery import Recovery
from traind.trainer.stack import build_stack
from traind.trainer.telemetry import Telemetry
from traind.trainer.threads import default_threads, local_ranks, usable_cpus
from traind.trainer.timing import PhaseTimer
from traind.trainer.vocab import fit_vocab
from traind.trainer.zero import state_bytes

if TYPE_CHECKING:
    import threading

    from traind.trainer.config import ArmConfig, TrainConfig
    from traind.trainer.distributed import DistInfo
    from traind.trainer.sink import EventSink


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What one call of :func:`train` did, on this rank."""

    step: int  # the last completed optimizer step
    loss: float | None  # training loss at the last telemetry step of this call
    val_loss: float | None  # validation loss at the last evaluation of this call
    tokens: int  # tokens this rank processed in this call
    seconds: float  # wall clock of this call's steps, evals and checkpoints (set-up excluded)
    tokens_per_second: float  # this rank's throughput; times world_size for the job's
    stopped: bool  # left early because ``stop`` was set
    resumed_from: int  # the step the call started from (0 = fresh)
    checkpoint: str | None  # the last checkpoint written (rank 0), if any
    rank: int
    world_size: int


def straggle(setting: str | None, rank: int) -> float:
    """Seconds ``rank`` sleeps before each step's compute under TRAIND_DEBUG_SLOW_RANK
    ("rank:seconds"; a fault injected by tests of straggler attribution), else 0."""
    if not setting:
        return 0.0
    who, _, seconds = setting.partition(":")
    try:
        return float(seconds) if int(who) == rank else 0.0
    except ValueError:
        raise ValueError(f"TRAIND_DEBUG_SLOW_RANK: {setting!r} is not rank:seconds") from None


def train(cfg: TrainConfig, sink: EventSink, *,
          stop: threading.Event | None = None) -> TrainResult:
    """Train ``cfg.job.steps`` optimizer steps (resuming from ``cfg.job.out_dir`` when asked),
    sending events to ``sink``. When ``stop`` is set, checkpoint and return early."""
    cfg = fit_vocab(cfg)  # the daemon's train_config did it already; a config made by hand not
    info = distributed.setup(cfg.job.device,
                             single_rank_group=cfg.parallel.single_rank_group)
    run: _Run | None = None
    try:
        run = _Run(cfg, sink, info, stop)
        with run.data:  # joins the prefetch thread on every way out of the run
            return run.run()
    finally:
        if info.owns_group and run is not None:
            _KEEP_UNTIL_EXIT.append(run)
        distributed.teardown(info)


# A rank that owns its process group leaves with os._exit (worker.py), so nothing of its run
# needs freeing; and freeing the DDP reducer when train() returns can deadlock: its
# ~ProcessGroupGloo waits on a mutex while a gloo thread waits for the GIL the freeing thread
# holds (a 2-rank job hung so in a suite run; py-spy showed both threads).
_KEEP_UNTIL_EXIT: list[_Run] = []


class _Run:
    """One call's state; methods are the loop's phases, read top to bottom in :meth:`run`."""

    def __init__(self, cfg: TrainConfig, sink: EventSink, info: DistInfo,
                 stop: threading.Event | None) -> None:
        self.cfg, self.info, self.stop = cfg, info, stop
        self.device = info.device
        self.telemetry = Telemetry(sink, info, cfg.telemetry, self.device)
        self.ledger = Ledger()  # where this worker's time goes (goodput's worker half)
        # This node's CPUs shared among this node's ranks (trainer/threads.py says why not
        # torch's count over the world size); the started event reports the figures.
        self.cpus = usable_cpus()
        self.local_ranks = local_ranks(os.environ, default=info.world_size)
        self.threads = cfg.job.threads or default_threads(self.cpus, self.local_ranks)
        torch.set_num_threads(self.threads)
        allow_tf32(self.device)  # CUDA: fp32 master weights at tensor-core speed

        self.stack = stack = build_stack(cfg, info, self.telemetry.emit)  # trainer/stack.py
        # the names every phase reads; ``precision`` is the running one (arms switch it)
        self.model, self.module, self.strategy = stack.model, stack.module, stack.strategy
        self.optimizer, self.precision = stack.optimizer, stack.precision
        self.shape, self.pipeline = stack.shape, stack.pipeline
        if self.shape.tp > 1 or self.shape.pp > 1:
            self.telemetry.probe_dim = "world"  # the probe's all-reduce spans every dimension
        self.hook = self._compression_hook()
        # Arms that all say compression "none" (as the form sends them) need no hook; any
        # other method does. The daemon refuses such an experiment before a launch (see
        # daemon/experiments.py); a job started by hand learns it here, before its first step.
        if bad := [f"interleave.arms.{i}.compression.method: {why}"
                   for i, arm in enumerate(cfg.interleave.arms)
                   if (why := self._no_compression(cfg.arm_compression(arm).method))]:
            raise ValueError("\n".join(["interleave.arms: compression arms need DDP", *bad]))
        # per-layer figures read the whole model's layers; a pipeline stage has some of them
        self.layers = (LayerStats(self.model) if cfg.telemetry.per_layer
                       and self.pipeline is None else None)
        self.schedule = Schedule(cfg.interleave) if cfg.interleave.arms else None
        self._arm_policies = self._arm_precision_policies()
        self._precision_mode = cfg.precision.mode
        self._slowdown = 0.0  # the running arm's planted slowdown (ArmConfig.slowdown)
        # A rank made slow on purpose (tests of straggler attribution; never set otherwise):
        # TRAIND_DEBUG_SLOW_RANK="rank:seconds" sleeps that rank before each step's compute.
        self._straggle = straggle(os.environ.get("TRAIND_DEBUG_SLOW_RANK"), info.rank)
        self.clock = ClockSync(0.0, 0.0)  # set at the start, with the other ranks (_begin)
        self.profiler = StepProfiler(rank=info.rank, device_type=self.device.type,
                                     out_dir=cfg.job.out_dir, emit=self.telemetry.emit,
                                     ledger=self.ledger, clock_offset=lambda: self.clock.offset)

        # the tp ranks of a dp group share their dp coordinate
        dp_rank = dp_coordinate(self.shape, self.stack.slot)
        self.data = DataPipeline.build(cfg.data, batch_size=cfg.job.batch_size,
                                       seq_len=cfg.model.seq_len, seed=cfg.job.seed,
                                       # the tp ranks of a dp group read one batch
                                       rank=dp_rank,
                                       world_size=self.shape.dp, device=self.device)
        # The held-out set is the global batch's (job.batch_size x dp sequences per batch),
        # each dp rank evaluating its share, as it trains on its share: so the set is the same
        # on every mesh of one global batch. Sized by job.batch_size alone, a mesh arm of the
        # tuner (daemon/autotune/mesh.py keeps the global batch: tp2 at batch 8 against dp2 at
        # batch 4) was judged on another held-out set than its baseline: a forked mesh round
        # whose arms trained identically measured a validation loss 0.067 apart, more than the
        # 0.05 margin (tests/daemon/test_autotune_mesh_trials.py).
        self.val = val_batches(self.data.val, batch_size=cfg.job.batch_size * self.shape.dp,
                               seq_len=cfg.model.seq_len, n_batches=cfg.job.eval_batches,
                               rank=dp_rank, world_size=self.shape.dp)
        self.control_seq = 0  # the last control message applied (contracts/control.py)
        self.numerics = NumericsGuard(cfg.numerics) if cfg.numerics.policy != "off" else None
        self.recovery = Recovery(cfg, info, model=self.model, optimizer=self.optimizer,
                                 strategy=self.strategy, data=self.data, hook=self.hook,
                                 numerics=self.numerics, emit=self.telemetry.emit)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg, tel, rec = self.cfg, self.telemetry, self.recovery
        accum = cfg.parallel.grad_accum
        # Per rank. A tp group and a pipeline's stages share one batch, so each of their
        # ranks is credited its share: per-rank tokens x world size stays the job's tokens.
        tokens_per_step = (cfg.job.batch_size * cfg.model.seq_len * accum
                           // (self.shape.tp * self.shape.pp))
        start = self._begin(tokens_per_step)
        model, policy, timer = self.module, self.precision, PhaseTimer(self.device)
        model.train()
        step, stopped, evaluated_at = start, False, -1
        loss_value: float | None = None
        val_loss: float | None = None
        tel.count_from(start, policy.skipped)
        if self.stack.tp_comm is not None:
            self.stack.tp_comm.counted_at = start
        t0 = time.perf_counter()
        ledger = self.ledger
        ledger.loop_started()

        while step < cfg.job.steps:  # not a range: a rollback sets ``step`` back
            step += 1
            report = step % cfg.telemetry.every == 0 or step == cfg.job.steps
            self.profiler.begin(step)  # a profile asked for: traced from here
            step_t0 = time.perf_counter()
            if self.schedule is not None:
                arm, starts = self.schedule.arm_for(step)
                if starts:
                    policy = self._switch_arm(arm, step)
            timer.start(enabled=report)
            lr = self._set_lr(step)
            layer_step = step % cfg.telemetry.layer_every == 0 or step == cfg.job.steps
            # tp's collectives are counted on layer steps only (trainer/tp_comm.py: why)
            tp_comm = self.stack.tp_comm if layer_step else None
            if self._straggle:
                time.sleep(self._straggle)
            with tp_comm.recording() if tp_comm is not None else contextlib.nullcontext():
                loss = self._micro_batches(model, timer, accum)
            policy.unscale(self.optimizer)  # true gradients for the norm, clipping and SNR
            layers = self.layers if layer_step else None
            if layers is not None:
                layers.before_step()
            skipped_before = policy.skipped
            grad_norm, verdict = self._optimizer_step(step, loss, policy)
            timer.mark("optimizer")
            if verdict is not None or policy.skipped != skipped_before:  # no update made
                ledger.add("numerics", time.perf_counter() - step_t0)
            if verdict is not None and verdict[0] == "rollback":
                self.profiler.end(step)
                with ledger.span("restore"):
                    step = tel.reported_at = rec.rollback(step, verdict[1], policy)
                continue
            step_seconds = self._block_seconds(step_t0) if self.schedule is not None else 0.0

            if report:  # the only host-device syncs telemetry adds
                loss_value = tel.step(step, loss=loss, lr=lr, grad_norm=grad_norm,
                                      phases=timer.read(), policy=policy,
                                      tokens=tokens_per_step, data=self.data, ledger=ledger,
                                      arrival=self._arrival())
                if self.hook is not None:
                    tel.comm(step, self.hook, self.module)
                if self.pipeline is not None:
                    tel.pipeline(step, self.pipeline)
            if layers is not None:
                tel.layers(step, layers)
            if tp_comm is not None:
                tel.mesh_comm(step, tp_comm)
            tel.probe(step)
            if self.schedule is not None:
                # Every step's loss (read after the step was timed): a block's mean over two
                # telemetry reports is too noisy for the quality guard's paired test.
                self._record_block(step, step_seconds, tokens_per_step,
                                   loss_value if report else loss.item())
            tel.precision(step, policy.after_step(step), policy, report=report)

            if step % cfg.job.eval_every == 0:
                val_loss, evaluated_at = self._evaluate(step), step
            if step % cfg.job.checkpoint_every == 0:
                with ledger.span("checkpoint"):
                    rec.checkpoint(step, policy)
                if self.schedule is None:  # an A/B job's arms own its settings
                    self._take_control(step)
                    policy = self.precision
            self.profiler.end(step)
            stop, probe, profile = self._agreed(report)
            if probe:
                self._probe_links_again(step)
            if profile:
                self.profiler.take_request(self.info)
            if stop:
                stopped = True
                break

        seconds = time.perf_counter() - t0
        self.profiler.close(step)  # a capture cut short by the stop: what it traced
        if not stopped and evaluated_at != step:  # a graceful stop skips eval: be quick
            val_loss = self._evaluate(step)
        if rec.written_at != step:
            with ledger.span("checkpoint"):
                rec.checkpoint(step, self.precision)
        return self._finished(start=start, step=step, seconds=seconds, stopped=stopped,
                              loss=loss_value, val_loss=val_loss,
                              tokens=(step - start) * tokens_per_step)

    # -- phases --------------------------------------------------------------------------------

    def _begin(self, tokens_per_step: int) -> int:
        """Resume from the newest checkpoint (or start fresh), say what the run is (the
        started event, and resumed when a checkpoint was loaded), and take the latest
        promoted setting; the step to continue from."""
        cfg, info = self.cfg, self.info
        with self.ledger.span("restore"):
            start, resumed_path = self.recovery.resume(self.precision)
        self.clock = synchronize(info)  # a collective: before anything rank 0 alone does
        self.telemetry.emit(LifecycleEvent(rank=info.rank, phase="started", step=start, detail={
            "params": self.stack.params,
            "flops_per_token": self.stack.flops_per_token,
            "device": str(self.device),
            "world_size": info.world_size,
            "total_steps": cfg.job.steps,
            "tokens_per_step": tokens_per_step * info.world_size,  # the whole job's
            "precision": cfg.precision.mode,
            "precision_modes": self.precision.modes(),
            **self.precision.details(),
            "compile": self.stack.compile_note,
            "strategy": self.strategy.name,
            "mesh": {"dp": self.shape.dp, "tp": self.shape.tp, "pp": self.shape.pp},
            "placement": cfg.parallel.placement,
            "rank_order": self.stack.order,  # the ranks in (pp, dp, tp) slot order
            "coordinates": coordinates(self.stack.slot, dp=self.shape.dp, tp=self.shape.tp,
                                       pp=self.shape.pp),  # this rank's
            **({"pipeline": {"stage": self.pipeline.stage,
                             "schedule": self.pipeline.schedule_name,
                             "microbatches": self.pipeline.microbatches,
                             "stage_params": sum(p.numel() for p in self.model.parameters())}}
               if self.pipeline is not None else {}),
            "grad_accum": cfg.parallel.grad_accum,
            "device_name": (name := device_name(self.device)),
            "peak_flops": peak_flops(name, cfg.precision.mode),  # of the math that runs
            "threads": self.threads,  # intra-op, per rank
            "local_ranks": self.local_ranks,
            "usable_cpus": self.cpus,
            # this rank's clock against rank 0's (trainer/clocksync.py): arrivals are shifted
            # by the offset, and agree to within the error
            "clock_offset": self.clock.offset,
            "clock_error": self.clock.error,
        }))
        if resumed_path is not None:
            self.telemetry.emit(LifecycleEvent(rank=info.rank, phase="resumed", step=start,
                                               detail={"step": start,
                                                       "path": str(resumed_path)}))
        if cfg.numerics.policy == "rollback" and resumed_path is None:
            # something to roll back to before the first checkpoint
            with self.ledger.span("checkpoint"):
                self.recovery.checkpoint(start, self.precision)
        self._take_control(start)  # a resumed job takes the latest promoted setting again
        return start

    def _arrival(self) -> float:
        """When this rank reached this step's first gradient collective, on the shared clock
        (0: no DDP hook to see it, e.g. FSDP, or one rank)."""
        hook = self.hook
        if hook is None or hook.arrived is None or self.info.world_size == 1:
            return 0.0
        return self.clock.shared(hook.arrived)

    def _set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _optimizer_step(self, step: int, loss: torch.Tensor, policy: PrecisionPolicy
                        ) -> tuple[torch.Tensor, tuple[str, Finding] | None]:
        """Clip the gradients, judge the step's numerics, and step the optimizer (or skip the
        update, as the numerics policy says); the grad norm and the verdict."""
        # a pipeline's stages hold different parameters: the norm is summed over them
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.grad_clip,
                                   self.pipeline.group if self.pipeline else None)
        verdict = self._check_numerics(step, loss, grad_norm, policy)
        if verdict is None:
            policy.step(self.optimizer)  # may skip (fp16 overflow): in policy.skipped
        else:
            policy.skip(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, verdict

    def _block_seconds(self, step_t0: float) -> float:
        """The step's time for its A/B block, without the telemetry that follows (probes,
        norms); on CUDA that needs the step's kernels finished: the one sync per step an
        interleaved experiment adds."""
        device_synchronize(self.device)  # CUDA's; on the CPU nothing is left to wait for
        seconds = time.perf_counter() - step_t0
        if self._slowdown:  # a planted slowdown is measured like the step's own compute
            time.sleep(self._slowdown * seconds)
            seconds = time.perf_counter() - step_t0
        return seconds

    def _record_block(self, step: int, seconds: float, tokens: int, loss: float | None
                      ) -> None:
        """The step's share of its A/B block; the block's event when the step ends it."""
        assert self.schedule is not None
        block = self.schedule.record(step, seconds=seconds, tokens=tokens, loss=loss)
        if block is not None:
            self.telemetry.block(step, block,
                                 self.hook.take_block_error() if self.hook else 0.0)

    def _agreed(self, report: bool) -> tuple[bool, ...]:
        """Whether to leave now (``stop`` is set), to probe the links again and to take a
        profile request (the daemon asked: contracts/control.PROBE_REQUEST or PROFILE_REQUEST
        in out_dir, which rank 0 looks for). Ranks must do each together, so with several the
        flags are agreed in one all-reduce, and only on telemetry steps, which sync with the
        device anyway."""
        if self.stop is None or not (report or self.info.world_size == 1):
            return False, False, False
        out = self.cfg.job.out_dir if self.info.rank == 0 else None
        probe = out is not None and self.info.world_size > 1 and (out / PROBE_REQUEST).exists()
        profile = out is not None and report and self.profiler.asked()
        return distributed.any_ranks((self.stop.is_set(), probe, profile), self.info)

    def _probe_links_again(self, step: int) -> None:
        """Every rank probes (a collective); rank 0 sends the matrix and takes the request."""
        measure_again(step, self.cfg.parallel.placement, self.stack.order, self.info,
                      self.telemetry.emit)
        if self.info.rank == 0 and self.cfg.job.out_dir is not None:
            (self.cfg.job.out_dir / PROBE_REQUEST).unlink(missing_ok=True)

    def _finished(self, *, start: int, step: int, seconds: float, stopped: bool,
                  loss: float | None, val_loss: float | None, tokens: int) -> TrainResult:
        """The finished event and what :func:`train` returns."""
        tps = tokens / seconds if seconds > 0 else 0.0
        self.telemetry.emit(LifecycleEvent(rank=self.info.rank, phase="finished", step=step,
                                           detail={"stopped": stopped, "tokens_per_second": tps,
                                                   "seconds": seconds, "loss": loss,
                                                   "val_loss": val_loss,
                                                   "peak_memory": peak_memory(self.device),
                                                   "optimizer_state_bytes": state_bytes(
                                                       self.optimizer),
                                                   "clock": self.ledger.snapshot(
                                                       self.data.stats().prefetch_wait_seconds)}))
        return TrainResult(step=step, loss=loss, val_loss=val_loss, tokens=tokens,
                           seconds=seconds, tokens_per_second=tps, stopped=stopped,
                           resumed_from=start, checkpoint=self.recovery.last_checkpoint,
                           rank=self.info.rank, world_size=self.info.world_size)


    def _arm_precision_policies(self) -> dict[str, PrecisionPolicy]:
        """A policy per precision an arm asks for (stateless modes: autocast only)."""
        modes = {a.precision for a in self.cfg.interleave.arms if a.precision}
        if modes and self.cfg.precision.mode not in SWITCHABLE_PRECISIONS:
            raise ValueError("interleave.arms: precision arms need precision.mode fp32 or "
                             f"bf16 as the base (not {self.cfg.precision.mode!r}): a scaler's "
                             "or the adaptive policy's state cannot be switched mid-run")
        policies: dict[str, PrecisionPolicy] = {self.cfg.precision.mode: self.precision}
        for mode in modes - policies.keys():
            policies[mode] = build_policy(self.cfg.precision.model_copy(update={"mode": mode}),
                                          self.device)
        return policies

    def _switch_arm(self, arm: ArmConfig, step: int) -> PrecisionPolicy:
        """At a block boundary: the arm's compression method and precision take over."""
        if self.hook is not None and any(a.compression for a in self.cfg.interleave.arms):
            # Close the previous arm's communication window so each window holds one method.
            self.telemetry.comm(step - 1, self.hook, self.module)
            c = self.cfg.arm_compression(arm)
            self.hook.set_method(c.method, **c.model_dump(exclude={"method"}))
        self._precision_mode = arm.precision or self.cfg.precision.mode
        self.precision = self._arm_policies[self._precision_mode]
        self._slowdown = arm.slowdown
        return self.precision

    def _take_control(self, step: int) -> None:
        """Apply a setting the daemon sent (contracts/control.py) if it is new. Collective: rank
        0 reads the file and every rank takes rank 0's message."""
        out_dir = self.cfg.job.out_dir
        if out_dir is None:
            return
        mine: tuple[Control | None, str | None] = (None, None)
        if self.info.rank == 0:
            try:
                mine = (read_control(out_dir / CONTROL_FILE), None)
            except ValueError as exc:
                mine = (None, str(exc))
        control, error = distributed.all_gather(mine, self.info)[0]
        if error is not None and self.info.rank == 0:
            self.telemetry.emit(LifecycleEvent(rank=0, phase="promoted", step=step,
                                               detail={"seq": None, "error": error}))
        if control is None or control.seq <= self.control_seq:
            return
        self.control_seq = control.seq
        try:
            self._apply_setting(control.setting, step)
            error = None
        except ValueError as exc:  # refused as a whole: the job keeps its setting
            error = str(exc)
        self.telemetry.emit(LifecycleEvent(rank=self.info.rank, phase="promoted", step=step,
                                           detail={"seq": control.seq,
                                                   "setting": control.setting, "error": error}))

    def _apply_setting(self, setting: dict[str, Any], step: int) -> None:
        """Switch compression and precision between steps; ``ValueError`` names the field
        and changes nothing."""
        precision = setting.get("precision") or self._precision_mode
        if (precision != self._precision_mode
                and {precision, self._precision_mode} - set(SWITCHABLE_PRECISIONS)):
            raise ValueError(f"setting.precision: {precision!r} cannot replace "
                                 f"{self._precision_mode!r} in a running job (only fp32 and "
                                 "bf16 switch without state)")
        comp = dict(setting.get("compression") or {})
        method = comp.pop("method", None)
        if method is not None and (why := self._no_compression(method)):
            raise ValueError(f"setting.compression.method: {why}")
        if method is not None and self.hook is not None:
            self.telemetry.comm(step, self.hook, self.module)  # the old method's window ends
            self.hook.set_method(method, **comp)
        if precision not in self._arm_policies:
            self._arm_policies[precision] = build_policy(
                self.cfg.precision.model_copy(update={"mode": precision}), self.device)
        self.precision = self._arm_policies[precision]
        self._precision_mode = precision

    def _compression_hook(self) -> CompressionHook | None:
        """DDP's communication hook, always installed under DDP so that an A/B arm can switch
        the method at a step boundary (``none`` is a plain averaged all-reduce)."""
        if self.strategy.ddp:
            hook = CompressionHook(self.cfg.compression,
                                   timed=self.cfg.telemetry.collectives)
            hook.register(self.module)  # type: ignore[arg-type]
            # fp16's buckets are loss-scaled: residuals are kept in true units. Through the
            # loop's current policy, since an A/B arm can swap it between blocks.
            hook.loss_scale = lambda: self.precision.scale_tensor()
            return hook
        if why := self._no_compression(self.cfg.compression.method):
            raise ValueError(f"compression.method {why}")
        return None

    def _no_compression(self, method: str) -> str | None:
        """Why this job cannot run compression ``method`` (None: it can). The rule is
        trainer/config.py's; it holds exactly where the strategy wrapped the model in DDP."""
        parallel = self.cfg.parallel
        return compression_unavailable(method, strategy=parallel.strategy,
                                       ranks=self.info.world_size,
                                       single_rank_group=parallel.single_rank_group,
                                       tp=parallel.tp, pp=parallel.pp)


    def _micro_batches(self, model: nn.Module, timer: PhaseTimer, accum: int) -> torch.Tensor:
        """Forward and backward over ``accum`` micro-batches; gradients are all-reduced only
        in the last one's backward. Returns the step's mean loss (a device tensor).

        Phase times add up over micro-batches: data, forward and backward alternate. A
        pipeline step is all "forward": its backward runs inside the schedule (the stage's
        own busy and idle split is telemetry's pipeline event)."""
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = self.data.next()  # (B, T) each
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            timer.mark("data")
            last = micro == accum - 1
            if self.pipeline is not None:  # the schedule runs forward and backward together
                with (contextlib.nullcontext() if last else self.strategy.no_sync(model),
                      self.precision.autocast()):
                    loss = self.pipeline.step(x, y)
                timer.mark("forward")
                timer.mark("backward")  # nothing left after the schedule's step: 0
                total += loss
                continue
            with contextlib.nullcontext() if last else self.strategy.no_sync(model):
                with self.precision.autocast():
                    _, loss = model(x, y)
                timer.mark("forward")
                self.precision.backward(loss / accum)
                timer.mark("backward")
            total += loss.detach()
        return total / accum

    def _check_numerics(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
                        policy: PrecisionPolicy) -> tuple[str, Finding] | None:
        """The numerics policy's action for this step and why (None: a healthy step, or
        policy off). Emits the event, except for a rollback (:meth:`Recovery.rollback` does).

        One host sync per step (and with several ranks one all-reduce of two numbers): the
        price of deciding before the optimizer step. Raises :class:`NumericsError` under
        ``fail``, and under ``rollback`` once ``max_rollbacks`` did not get past the trouble."""
        if self.numerics is None:
            return None
        values = torch.stack([loss.detach().float(), whole(grad_norm).detach().float()])
        mean_loss, norm = distributed.mean(values, self.info)
        # Under a GradScaler inf gradients are routine (a scale too high): it skips those
        # steps and backs off itself, so only the loss is judged there.
        finding = self.numerics.check(mean_loss, norm, check_grads=not policy.scaled)
        if finding is None:
            return None
        action = self.cfg.numerics.policy
        if action == "rollback" and self.recovery.rollbacks >= self.cfg.numerics.max_rollbacks:
            action = "fail"
        if action != "rollback":
            self.telemetry.emit(NumericsEvent(rank=self.info.rank, step=step, action=action,
                                              reason=finding.reason, value=finding.value,
                                              limit=finding.limit))
        if action == "fail":
            raise NumericsError(self._failure(step, finding))
        return action, finding

    def _failure(self, step: int, finding: Finding) -> str:
        cfg = self.cfg.numerics
        if cfg.policy == "rollback":
            return (f"numerics: {finding.describe(step)}; {cfg.max_rollbacks} rollbacks "
                    "(numerics.max_rollbacks) did not get past it")
        return f"numerics: {finding.describe(step)} (numerics.policy is fail)"


    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        """Mean loss over the fixed validation batches. Each dp rank evaluates its share of
        them on its unwrapped model (a tp group its share together; a pipeline passes it
        through its stages and broadcasts the last one's loss), and one all-reduce averages
        the shares, so all ranks report one number."""
        with self.ledger.span("eval"):
            return self._evaluate_timed(step)

    def _evaluate_timed(self, step: int) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in self.val:
            with self.precision.autocast():
                if self.pipeline is not None:  # the stages in turn; the last one's loss
                    loss = self.pipeline.eval(x.to(self.device), y.to(self.device))
                else:
                    _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss
        self.model.train()
        # Every rank of a dp coordinate holds that share's total (tp ranks alike, pipeline
        # stages by the broadcast), so the mean over all ranks is the mean over the shares.
        (share_total,) = distributed.mean(total.reshape(1), self.info)
        val_loss = share_total / len(self.val)
        self.telemetry.emit(EvalEvent(rank=self.info.rank, step=step, val_loss=val_loss,
                                      batches=len(self.val)))
        return val_loss
