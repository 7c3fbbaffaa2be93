"""The training loop: the one thing ``traind run`` and the daemon's workers both call.

Hot-path rules (DESIGN.md): the host reads loss and grad norm only on telemetry steps, events go
to a sink that never blocks, and phase timing on CUDA is read from events, not synchronised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from traind.trainer import distributed
from traind.trainer.attention import choose_ahead
from traind.trainer.checkpoint import (
    checkpoint_path,
    is_sharded,
    latest,
    load_checkpoint,
    load_sharded,
    save_checkpoint,
    save_sharded,
)
from traind.trainer.compile import compile_blocks, should_compile
from traind.trainer.compression import CompressionHook
from traind.trainer.control import FILENAME as CONTROL_FILE
from traind.trainer.control import Control, read_control
from traind.trainer.data import val_batches
from traind.trainer.device import allocator_stats, device_name, peak_flops
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
from traind.trainer.interleave import Schedule
from traind.trainer.layers import LayerStats
from traind.trainer.model import GPT
from traind.trainer.numerics import Finding, NumericsError, NumericsGuard
from traind.trainer.optim import clip_grad_norm, lr_at
from traind.trainer.parallel import build_strategy, ddp_timing, local_tensor
from traind.trainer.pipeline import DataPipeline
from traind.trainer.precision import AdaptivePolicy, PrecisionPolicy, build_policy
from traind.trainer.probe import all_reduce_probe
from traind.trainer.timing import PhaseTimer

if TYPE_CHECKING:
    import threading
    from pathlib import Path

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


def train(cfg: TrainConfig, sink: EventSink, *,
          stop: threading.Event | None = None) -> TrainResult:
    """Train ``cfg.job.steps`` optimizer steps (resuming from ``cfg.job.out_dir`` when asked),
    sending events to ``sink``. When ``stop`` is set, checkpoint and return early."""
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
        self.cfg, self.sink, self.info, self.stop = cfg, sink, info, stop
        self.device = info.device
        torch.set_num_threads(cfg.job.threads or max(1, torch.get_num_threads() // info.world_size))
        if self.device.type == "cuda":  # TF32 matmuls: fp32 master weights at tensor-core speed
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        # Same seed on every rank for the weights (DDP also broadcasts rank 0's); then a per-rank
        # seed so dropout masks differ between ranks.
        torch.manual_seed(cfg.job.seed)
        self.model = GPT(cfg.model).to(self.device)
        # Precision first: fp8 swaps Linear layers, adaptive hooks blocks; both before wrapping.
        self.precision = build_policy(cfg.precision, self.device)
        self.precision.prepare(self.model)  # in place: the same module comes back
        # Compile after precision (the graphs capture fp8's Linear layers) and before the
        # wrap (torchtitan's order: FSDP's hooks stay outside the compiled forwards).
        self.compile_note = self._compile_blocks()
        torch.manual_seed(cfg.job.seed + 1_000_003 * info.rank)
        self.strategy = build_strategy(cfg.parallel, info, cfg.precision.mode)
        # Wrap before building the optimizer: FSDP replaces parameters with sharded DTensors.
        self.module = self.strategy.wrap(self.model)
        self.optimizer = self.strategy.optimizer(self.model, cfg.optim)
        self.sharded_checkpoints = self.strategy.sharded or cfg.parallel.sharded_checkpoints
        self.hook = self._compression_hook()
        # Arms that all say compression "none" (as the form sends them) need no hook; any
        # other method does. The daemon refuses such an experiment before a launch (see
        # daemon/experiments.py); a job started by hand learns it here, before its first step.
        if self.hook is None and any(cfg.arm_compression(a).method != "none"
                                     for a in cfg.interleave.arms):
            raise ValueError("interleave.arms: compression arms need DDP (more than one "
                             "rank and parallel.strategy ddp or zero1)")
        self.layers = LayerStats(self.model) if cfg.telemetry.per_layer else None
        self.schedule = Schedule(cfg.interleave) if cfg.interleave.arms else None
        self._arm_policies = self._arm_precision_policies()
        self._precision_mode = cfg.precision.mode

        self.data = DataPipeline.build(cfg.data, batch_size=cfg.job.batch_size,
                                       seq_len=cfg.model.seq_len, seed=cfg.job.seed,
                                       rank=info.rank, world_size=info.world_size,
                                       device_type=self.device.type)
        self.val = val_batches(self.data.val, batch_size=cfg.job.batch_size,
                               seq_len=cfg.model.seq_len, n_batches=cfg.job.eval_batches)
        self.out_dir: Path | None = cfg.job.out_dir
        self.control_seq = 0  # the last control message applied (trainer/control.py)
        self.last_checkpoint: str | None = None
        self.numerics = NumericsGuard(cfg.numerics) if cfg.numerics.policy != "off" else None
        self.rollbacks = 0  # since the last checkpoint written
        if cfg.numerics.policy == "rollback" and self.out_dir is None:
            raise ValueError("numerics.policy: rollback restores the last checkpoint, so it "
                             "needs job.out_dir")

    def _compile_blocks(self) -> str:
        """Compile the blocks if ``job.compile`` says so; the started event's note on it."""
        cfg = self.cfg
        step_flops = (self.model.flops_per_token() * cfg.job.batch_size * cfg.model.seq_len
                      * cfg.parallel.grad_accum)
        on, why = should_compile(cfg.job.compile, self.device.type, steps=cfg.job.steps,
                                 step_flops=step_flops)
        if not on:
            return f"off ({why})"
        # The attention backend is timed eagerly now: inside the trace nothing is timed, and
        # the compiled blocks would keep the static rule's pick. Training and evaluation.
        m = cfg.model
        shape = (cfg.job.batch_size, m.n_heads, m.seq_len, m.d_model // m.n_heads)
        for grad in (True, False):
            choose_ahead(m, shape, self.device, self.precision.compute_dtype, grad=grad)

        def fell_back(reason: str) -> None:
            self._emit(LifecycleEvent(rank=self.info.rank, phase="compile_fallback", step=0,
                                      detail={"reason": reason}))

        compile_blocks(self.model, on_fallback=fell_back)  # the blocks keep what it made
        return f"on ({why})"

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg, info = self.cfg, self.info
        start, resumed_path = self._resume()
        accum = cfg.parallel.grad_accum
        tokens_per_step = cfg.job.batch_size * cfg.model.seq_len * accum  # per rank
        self._emit(LifecycleEvent(rank=info.rank, phase="started", step=start, detail={
            "params": self.model.num_params(),
            "flops_per_token": self.model.flops_per_token(),
            "device": str(self.device),
            "world_size": info.world_size,
            "total_steps": cfg.job.steps,
            "tokens_per_step": tokens_per_step * info.world_size,  # the whole job's
            "precision": cfg.precision.mode,
            "precision_modes": self.precision.modes(),
            **self.precision.details(),
            "compile": self.compile_note,
            "strategy": self.strategy.name,
            "grad_accum": accum,
            "device_name": (name := device_name(self.device)),
            "peak_flops": peak_flops(name),
        }))
        if resumed_path is not None:
            self._emit(LifecycleEvent(rank=info.rank, phase="resumed", step=start,
                                      detail={"step": start, "path": str(resumed_path)}))

        if (self.cfg.numerics.policy == "rollback" and resumed_path is None
                and self.out_dir is not None):
            self._checkpoint(start)  # something to roll back to before the first checkpoint
        self._take_control(start)  # a resumed job takes the latest promoted setting again
        model = self.module
        model.train()
        policy = self.precision
        timer = PhaseTimer(self.device)
        every = cfg.telemetry.every
        step, stopped = start, False
        loss_value: float | None = None
        val_loss: float | None = None
        evaluated_at, checkpointed_at = -1, start if resumed_path is not None else -1
        reported_at, skipped_at_report = start, policy.skipped
        t0 = time.perf_counter()

        step = start
        while step < cfg.job.steps:  # not a range: a rollback sets ``step`` back
            step += 1
            report = step % every == 0 or step == cfg.job.steps
            step_t0 = time.perf_counter()
            if self.schedule is not None:
                arm, starts = self.schedule.arm_for(step)
                if starts:
                    policy = self._switch_arm(arm, step)
            timer.start(enabled=report)
            lr = lr_at(step, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss = self._micro_batches(model, timer, accum)
            policy.unscale(self.optimizer)  # true gradients for the norm, clipping and SNR
            layers = self.layers if (step % cfg.telemetry.layer_every == 0
                                     or step == cfg.job.steps) else None
            if layers is not None:
                layers.before_step()
            grad_norm = clip_grad_norm(self.model.parameters(), cfg.optim.grad_clip)
            verdict = self._check_numerics(step, loss, grad_norm, policy)
            if verdict is None:
                policy.step(self.optimizer)  # may skip (fp16 overflow): in policy.skipped
            else:
                policy.skip(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            timer.mark("optimizer")
            if verdict is not None and verdict[0] == "rollback":
                step = reported_at = checkpointed_at = self._rollback(step, verdict[1])
                continue
            if self.schedule is not None:
                # An A/B block times its steps without the telemetry that follows (probes,
                # norms); on CUDA that needs the step's kernels finished: the one sync per
                # step an interleaved experiment adds.
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                step_seconds = time.perf_counter() - step_t0

            if report:  # the only host-device syncs telemetry adds
                t = timer.read()
                loss_value = loss.item()
                self._emit(StepEvent(
                    rank=info.rank, step=step, loss=loss_value, lr=lr,
                    grad_norm=local_tensor(grad_norm).item(), tokens=tokens_per_step,
                    step_seconds=t["total"], data_seconds=t["data"],
                    forward_seconds=t["forward"], backward_seconds=t["backward"],
                    optimizer_seconds=t["optimizer"], dropped_events=self.sink.dropped,
                    steps=step - reported_at, skipped_steps=policy.skipped - skipped_at_report,
                    loss_scale=policy.loss_scale, nonfinite=not math.isfinite(loss_value),
                    cuda_memory=allocator_stats(self.device), time=time.time(),
                ))
                reported_at, skipped_at_report = step, policy.skipped
                self._emit(DataEvent(rank=info.rank, step=step,
                                     **dataclasses.asdict(self.data.stats())))
                if self.hook is not None:
                    self._emit_comm(step)
            if layers is not None:
                grads, weights, ratios = layers.after_step()
                if info.rank == 0:
                    self._emit(LayerEvent(rank=0, step=step, layers=layers.names,
                                          grad_norm=grads, weight_norm=weights,
                                          update_ratio=ratios))
            probe_every = cfg.telemetry.probe_every
            if probe_every and info.world_size > 1 and step % probe_every == 0:
                sizes = cfg.telemetry.probe_sizes
                latency = all_reduce_probe(sizes, cfg.telemetry.probe_repeats, self.device)
                self._emit(ProbeEvent(rank=info.rank, step=step, op="all_reduce",
                                      world_size=info.world_size, sizes=sizes,
                                      seconds=latency))
            if self.schedule is not None:
                # Every step's loss (read after the step was timed): a block's mean over two
                # telemetry reports is too noisy for the quality guard's paired test.
                block = self.schedule.record(
                    step, seconds=step_seconds, tokens=tokens_per_step,
                    loss=loss_value if report else loss.item())
                if block is not None:
                    self._emit(ArmEvent(rank=info.rank, step=step, arm=block.arm,
                                        block=block.block, steps=block.steps,
                                        tokens=block.tokens, seconds=block.seconds,
                                        loss=block.loss, grad_error=(
                                            self.hook.take_block_error() if self.hook
                                            else 0.0)))
            for switch in policy.after_step(step):
                self._emit(PrecisionEvent(rank=info.rank, step=step, group=switch.group,
                                          before=switch.before, after=switch.after,
                                          snr=switch.snr))
            if report and isinstance(policy, AdaptivePolicy) and (snrs := policy.last_snr()):
                # every group's SNR at every report (the switches above are only the changes)
                modes = policy.modes()
                self._emit(SNREvent(rank=info.rank, step=step, window_step=policy.snr_step,
                                    groups=list(snrs), snr=list(snrs.values()),
                                    modes=[modes[g] for g in snrs]))
            if step % cfg.job.eval_every == 0:
                val_loss, evaluated_at = self._evaluate(step), step
            if step % cfg.job.checkpoint_every == 0:
                self._checkpoint(step)
                checkpointed_at = step
                if self.schedule is None:  # an A/B job's arms own its settings
                    self._take_control(step)
                    policy = self.precision
            # Ranks must leave together, so with several the stop flag is agreed by an
            # all-reduce, and only on telemetry steps, which sync with the device anyway.
            if (self.stop is not None and (report or info.world_size == 1)
                    and distributed.any_rank(self.stop.is_set(), info)):
                stopped = True
                break

        seconds = time.perf_counter() - t0
        if not stopped and evaluated_at != step:  # a graceful stop skips eval: be quick
            val_loss = self._evaluate(step)
        if checkpointed_at != step:
            self._checkpoint(step)
        tokens = (step - start) * tokens_per_step
        tps = tokens / seconds if seconds > 0 else 0.0
        self._emit(LifecycleEvent(rank=info.rank, phase="finished", step=step, detail={
            "stopped": stopped, "tokens_per_second": tps, "seconds": seconds,
            "loss": loss_value, "val_loss": val_loss,
        }))
        return TrainResult(step=step, loss=loss_value, val_loss=val_loss, tokens=tokens,
                           seconds=seconds, tokens_per_second=tps, stopped=stopped,
                           resumed_from=start, checkpoint=self.last_checkpoint,
                           rank=info.rank, world_size=info.world_size)

    # -- phases --------------------------------------------------------------------------------

    def _arm_precision_policies(self) -> dict[str, PrecisionPolicy]:
        """A policy per precision an arm asks for (stateless modes: autocast only)."""
        modes = {a.precision for a in self.cfg.interleave.arms if a.precision}
        if modes and self.cfg.precision.mode not in ("fp32", "bf16"):
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
            self._emit_comm(step - 1)
            c = self.cfg.arm_compression(arm)
            self.hook.set_method(c.method, **c.model_dump(exclude={"method"}))
        self._precision_mode = arm.precision or self.cfg.precision.mode
        self.precision = self._arm_policies[self._precision_mode]
        return self.precision

    def _take_control(self, step: int) -> None:
        """Apply a setting the daemon sent (trainer/control.py) if it is new. Collective: rank
        0 reads the file and every rank takes rank 0's message."""
        if self.out_dir is None:
            return
        mine: tuple[Control | None, str | None] = (None, None)
        if self.info.rank == 0:
            try:
                mine = (read_control(self.out_dir / CONTROL_FILE), None)
            except ValueError as exc:
                mine = (None, str(exc))
        control, error = distributed.all_gather(mine, self.info)[0]
        if error is not None and self.info.rank == 0:
            self._emit(LifecycleEvent(rank=0, phase="promoted", step=step,
                                      detail={"seq": None, "error": error}))
        if control is None or control.seq <= self.control_seq:
            return
        self.control_seq = control.seq
        try:
            self._apply_setting(control.setting, step)
            error = None
        except ValueError as exc:  # refused as a whole: the job keeps its setting
            error = str(exc)
        self._emit(LifecycleEvent(rank=self.info.rank, phase="promoted", step=step, detail={
            "seq": control.seq, "setting": control.setting, "error": error}))

    def _apply_setting(self, setting: dict[str, Any], step: int) -> None:
        """Switch compression and precision between steps; ``ValueError`` names the field
        and changes nothing."""
        precision = setting.get("precision") or self._precision_mode
        if precision != self._precision_mode and {precision, self._precision_mode} - {"fp32",
                                                                                 "bf16"}:
            raise ValueError(f"setting.precision: {precision!r} cannot replace "
                                 f"{self._precision_mode!r} in a running job (only fp32 and "
                                 "bf16 switch without state)")
        comp = dict(setting.get("compression") or {})
        method = comp.pop("method", None)
        if method is not None and self.hook is None and method != "none":
            raise ValueError(f"setting.compression.method: {method!r} needs DDP (more than "
                             "one rank, parallel.strategy ddp or zero1)")
        if method is not None and self.hook is not None:
            self._emit_comm(step)  # the old method's window ends here
            self.hook.set_method(method, **comp)
        if precision not in self._arm_policies:
            self._arm_policies[precision] = build_policy(
                self.cfg.precision.model_copy(update={"mode": precision}), self.device)
        self.precision = self._arm_policies[precision]
        self._precision_mode = precision

    def _emit_comm(self, step: int) -> None:
        """The hook's window since the last report, as one event (and a fresh window)."""
        assert self.hook is not None
        stats = self.hook.take_stats()
        ddp = self.module._get_ddp_logging_data()  # type: ignore[operator]
        self._emit(CommEvent(rank=self.info.rank, step=step, method=self.hook.method,
                             **{**dataclasses.asdict(stats),
                                "collectives": list(stats.collectives)},
                             ddp=ddp_timing(ddp), world_size=self.info.world_size))

    def _compression_hook(self) -> CompressionHook | None:
        """DDP's communication hook, always installed under DDP so that an A/B arm can switch
        the method at a step boundary (``none`` is a plain averaged all-reduce)."""
        method = self.cfg.compression.method
        if self.strategy.ddp:
            hook = CompressionHook(self.cfg.compression)
            hook.register(self.module)  # type: ignore[arg-type]
            # fp16's buckets are loss-scaled: residuals are kept in true units. Through the
            # loop's current policy, since an A/B arm can swap it between blocks.
            hook.loss_scale = lambda: self.precision.scale_tensor()
            return hook
        if method != "none":
            raise ValueError(
                f"compression.method {method!r} compresses DDP's gradient all-reduce: it needs "
                f"more than one rank (job.nproc_per_node x job.nnodes = "
                f"{self.info.world_size}) and parallel.strategy ddp or zero1 "
                f"(not {self.cfg.parallel.strategy!r})")
        return None

    def _micro_batches(self, model: nn.Module, timer: PhaseTimer, accum: int) -> torch.Tensor:
        """Forward and backward over ``accum`` micro-batches; gradients are all-reduced only
        in the last one's backward. Returns the step's mean loss (a device tensor).

        Phase times add up over micro-batches: data, forward and backward alternate."""
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = self.data.next()  # (B, T) each
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            timer.mark("data")
            last = micro == accum - 1
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
        policy off). Emits the event, except for a rollback (:meth:`_rollback` does).

        One host sync per step (and with several ranks one all-reduce of two numbers): the
        price of deciding before the optimizer step. Raises :class:`NumericsError` under
        ``fail``, and under ``rollback`` once ``max_rollbacks`` did not get past the trouble."""
        if self.numerics is None:
            return None
        values = torch.stack([loss.detach().float(), local_tensor(grad_norm).detach().float()])
        mean_loss, norm = distributed.mean(values, self.info)
        # Under a GradScaler inf gradients are routine (a scale too high): it skips those
        # steps and backs off itself, so only the loss is judged there.
        finding = self.numerics.check(mean_loss, norm, check_grads=not policy.scaled)
        if finding is None:
            return None
        action = self.cfg.numerics.policy
        if action == "rollback" and self.rollbacks >= self.cfg.numerics.max_rollbacks:
            action = "fail"
        if action != "rollback":
            self._emit(NumericsEvent(rank=self.info.rank, step=step, action=action,
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

    def _rollback(self, step: int, finding: Finding) -> int:
        """Restore the last checkpoint, keeping the data position: the batches trained on
        since it (the offending ones among them) are skipped, as PaLM did for its loss spikes
        (restart ~100 steps back, skip a few hundred batches). The step to continue from."""
        assert self.out_dir is not None  # checked in __init__
        path = latest(self.out_dir)
        if path is None:
            raise NumericsError(f"numerics: rollback at step {step} found no complete "
                                f"checkpoint in {self.out_dir}")
        sampler = self.data.state_dict()
        resume = self._restore(path)
        self.data.load_state_dict(sampler)
        self.rollbacks += 1
        self._emit(NumericsEvent(rank=self.info.rank, step=step, action="rollback",
                                 reason=finding.reason, value=finding.value,
                                 limit=finding.limit, resume_step=resume,
                                 skipped_batches=step - resume))
        return resume

    def _emit(self, event: Event) -> None:
        if not event.time:
            event = dataclasses.replace(event, time=time.time())
        self.sink.emit(event)

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        """Mean loss over the fixed validation batches. Every rank evaluates the same batches
        on its unwrapped model, so no collective is needed and all ranks report one number."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in self.val:
            with self.precision.autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss
        self.model.train()
        val_loss = (total / len(self.val)).item()
        self._emit(EvalEvent(rank=self.info.rank, step=step, val_loss=val_loss,
                             batches=len(self.val)))
        return val_loss

    def _checkpoint(self, step: int) -> None:
        """Every rank takes part (state gathering and sharded writes are collectives); rank 0
        writes the single file, or the unsharded extras of a sharded one."""
        if self.out_dir is None:
            return
        t0 = time.perf_counter()
        extra = {
            "step": step,
            "sampler": self.data.state_dict(),
            "rng": distributed.all_gather(_rng_state(), self.info),  # every rank's: exact resume
            "world_size": self.info.world_size,
            "precision_modes": self.precision.modes(),
            "strategy": self.strategy.name,
            "config": self.cfg.model_dump(mode="json"),
            "precision": self.precision.state_dict(),
            # Per rank: error-feedback residuals are each rank's own debt.
            "compression": distributed.all_gather(
                self.hook.state_dict() if self.hook else None, self.info),
            "numerics": self.numerics.state_dict() if self.numerics else None,
        }
        if self.sharded_checkpoints:
            model_state, opt_state = self.strategy.sharded_state(self.model, self.optimizer)
            path = save_sharded(self.out_dir, step, {"model": model_state, "optim": opt_state},
                                extra, keep_last=self.cfg.job.keep_last, rank=self.info.rank,
                                barrier=lambda: distributed.barrier(self.info))
        else:
            model_state, opt_state = self.strategy.full_state(self.model, self.optimizer)
            path = checkpoint_path(self.out_dir, step)
            if self.info.rank == 0:
                save_checkpoint(self.out_dir, step,
                                {**extra, "model": model_state, "optimizer": opt_state},
                                keep_last=self.cfg.job.keep_last)
            distributed.barrier(self.info)  # nobody runs ahead of a checkpoint being written
        self.last_checkpoint = str(path)
        self.rollbacks = 0  # past the trouble: rollbacks count afresh from here
        if self.info.rank == 0:
            self._emit(LifecycleEvent(rank=0, phase="checkpoint", step=step, detail={
                "path": self.last_checkpoint, "seconds": time.perf_counter() - t0,
                "sharded": self.sharded_checkpoints}))

    def _resume(self) -> tuple[int, Path | None]:
        """Load the newest complete checkpoint in ``out_dir``; the step to continue from.

        A single-file checkpoint holds the full state, so it resumes on any number of ranks;
        a sharded one is resharded by torch.distributed.checkpoint."""
        if not (self.cfg.job.resume and self.out_dir is not None):
            return 0, None
        path = latest(self.out_dir)
        if path is None:
            return 0, None
        return self._restore(path), path

    def _restore(self, path: Path) -> int:
        """Load every piece of state a checkpoint holds; the step it was written at."""
        if is_sharded(path):
            model_state, opt_state = self.strategy.sharded_state(self.model, self.optimizer)
            state = {"model": model_state, "optim": opt_state}
            extra = load_sharded(path, state)
            self.strategy.load_sharded_state(self.model, self.optimizer, state["model"],
                                             state["optim"])
        else:
            extra = load_checkpoint(path)
            if self.sharded_checkpoints:
                raise ValueError(f"{path} is a single-file checkpoint, but strategy "
                                 f"{self.strategy.name} resumes from sharded ones only")
            self.strategy.load_full_state(self.model, self.optimizer, extra["model"],
                                          extra["optimizer"])
        self.data.load_state_dict(extra["sampler"])
        if self.numerics is not None:
            self.numerics.load_state_dict(extra.get("numerics"))
        if "precision" in extra:
            self.precision.load_state_dict(extra["precision"])
        hooks = extra.get("compression") or []
        if self.hook is not None and len(hooks) == self.info.world_size and hooks[self.info.rank]:
            self.hook.load_state_dict(hooks[self.info.rank])
        rngs = extra["rng"]
        if len(rngs) == self.info.world_size:
            _set_rng_state(rngs[self.info.rank])
        # else: a restart at another world size; dropout masks simply differ from an
        # uninterrupted run (the data order does not: the sampler state is the batch index)
        return int(extra["step"])


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):
            torch.cuda.set_rng_state(state["cuda"])
