"""Precision policies: how the forward is cast, how the loss is scaled, and when a step is skipped.

A policy is chosen by name (``precision.mode``) through :func:`build_policy`; the loop drives it
with the same calls whatever the mode, once per optimizer step::

    policy = build_policy(cfg.precision, device)     # fp8 raises ValueError here if unsupported
    model = policy.prepare(model)                    # before the optimizer and before DDP
    ...
    with policy.autocast():
        _, loss = model(x, y)
    policy.backward(loss)                            # once per micro-batch
    policy.unscale(optimizer)                        # true-scale gradients, before clipping
    grad_norm = clip_grad_norm(model.parameters(), clip)
    stepped = policy.step(optimizer)                 # False: the fp16 scaler skipped it
    optimizer.zero_grad(set_to_none=True)
    for s in policy.after_step(step): emit PrecisionEvent(rank, step, s.group, s.before, ...)

Master weights and optimizer state stay fp32 in every mode: autocast casts copies per op, and
fp8 (torchao) keeps fp32 weights and casts per matmul. The decisions are pure functions
(:func:`next_mode`, :func:`fp8_unsupported_reason`, :func:`snr_from_moments`) tested by tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from traind.kernels._dispatch import is_dtensor
from traind.kernels.grad_stats import group_sq_norms
from traind.trainer.fp8_support import (
    fp8_emulated,
    fp8_unsupported_reason,
    quiet_torchao_import,
    torchao_available,
)
from traind.trainer.model import layer_groups

if TYPE_CHECKING:

    from traind.trainer.config import PrecisionConfig

log = logging.getLogger("traind")

_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class Switch:
    """A parameter group changed compute precision; the loop turns it into a PrecisionEvent."""

    group: str  # "embed", "block.0", ..., "head"
    before: str  # fp32 | bf16 | fp16
    after: str
    snr: float  # the group's gradient SNR over the window that decided it


class PrecisionPolicy:
    """fp32, and the base of the others: no casting, no scaling; an optional GradScaler.

    Subclasses override :meth:`autocast`, :meth:`prepare` and :meth:`after_step`; the scaler
    bookkeeping lives here so fp16 and adaptive(low=fp16) share one tested path.
    """

    name: ClassVar[str] = "fp32"
    # The dtype the matmuls of a block compute in (adaptive: fp32 until a block drops); what
    # FSDP gathers parameters in and what the attention backend is measured with.
    compute_dtype: ClassVar[torch.dtype] = torch.float32

    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self._scaler: torch.amp.GradScaler | None = None
        self._skipped = 0
        self._unscaled = False  # unscale() already ran for this step
        self._overflow_group: dist.ProcessGroup | None = None  # see agree_on_overflow

    def prepare(self, model: nn.Module) -> nn.Module:
        """Adapt the (unwrapped) model in place, once, before the optimizer and DDP see it."""
        return model

    def autocast(self) -> AbstractContextManager[Any]:
        """Context for the forward pass (training and evaluation)."""
        return contextlib.nullcontext()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (itself when there is no scaler): what backward
        starts from. A pipeline's schedule runs the backward itself, from this."""
        return loss if self._scaler is None else self._scaler.scale(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled when there is a scaler)."""
        self.scale(loss).backward()

    def agree_on_overflow(self, group: dist.ProcessGroup) -> None:
        """Make an inf/NaN gradient on any rank of ``group`` skip the step on all of them:
        ranks holding *different* parameters (a pipeline's stages) each find only their own,
        and a stage that stepped while another skipped would leave the model torn and the
        scales apart."""
        self._overflow_group = group
        if self._scaler is not None:
            # GradScaler makes its scale at its first scale(); a stage without the loss never
            # calls it, yet unscales its gradients (scaled by the last stage's loss) each step
            self._scaler.scale(torch.zeros((), device=self.device))

    def split_over_stages(self, stage: nn.Module, group: dist.ProcessGroup) -> None:
        """This rank holds one pipeline stage, ``stage``, of the model ``prepare`` saw; the
        other stages are on the ranks of ``group``. Nothing to do unless the policy keeps
        state per part of the model (adaptive)."""

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale; call after the last backward, before clipping
        (clipping a scaled gradient would clip at ``scale * max_norm``). Idempotent per step."""
        if self._unscaled:
            return
        if self._scaler is not None:
            # Under FSDP2 the gradients are DTensor shards, and the scaler's overflow check
            # runs through DTensor's sharding rules, which agree on it across the ranks: an
            # inf in one rank's shard skips the step everywhere (tests/trainer/test_parallel.py).
            self._scaler.unscale_(optimizer)
            if self._overflow_group is not None:
                # in place: the scaler's step and update read these very tensors
                for found in self._scaler._found_inf_per_device(optimizer).values():
                    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._overflow_group)
        self._unscaled = True
        self._gradients_ready()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step; False when the scaler skipped it for inf/NaN gradients."""
        self.unscale(optimizer)
        self._unscaled = False
        if self._scaler is None:
            optimizer.step()
            return True
        # Whether the scaler will skip: its found_inf from unscale_ (through its one private
        # accessor, also what FSDP's ShardedGradScaler uses; comparing get_scale() before and
        # after would cost two syncs). The scaler reads it on the host itself for non-fused
        # optimizers, so this adds no sync there; with a fused one it is the one sync fp16 adds.
        found = sum(self._scaler._found_inf_per_device(optimizer).values())
        skipped = bool(torch.as_tensor(found).item())
        self._scaler.step(optimizer)
        self._scaler.update()  # halves the scale after a skip, grows it after a clean run
        self._skipped += skipped
        return not skipped

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step's update (the numerics policy decided so). A scaler still closes its
        iteration: the next ``unscale_`` is allowed, and inf gradients still halve the scale."""
        self.unscale(optimizer)
        self._unscaled = False
        if self._scaler is not None:
            self._scaler.update()

    @property
    def scaled(self) -> bool:
        """A GradScaler guards the steps (it skips those with inf/NaN gradients itself)."""
        return self._scaler is not None

    def after_step(self, step: int) -> list[Switch]:
        """Called after every optimizer step (``step`` is 1-based); switches made, if any."""
        return []

    @property
    def loss_scale(self) -> float:
        """The scaler's current scale (1.0 without one). Reads the device: telemetry steps only."""
        return 1.0 if self._scaler is None else self._scaler.get_scale()

    def scale_tensor(self) -> torch.Tensor | None:
        """The scaler's current scale as a 0-dim device tensor, no host sync (None without a
        scaler, or before its first backward): the compression hook keeps error-feedback
        residuals in true units with it. The scaler updates it in place, so read it anew."""
        if self._scaler is None or not self._scaler.is_enabled():
            return None
        return self._scaler._scale  # GradScaler's only handle on it without a .item()

    @property
    def skipped(self) -> int:
        """Optimizer steps the scaler skipped so far (cumulative, kept across resumes)."""
        return self._skipped

    def modes(self) -> dict[str, str]:
        """Current compute precision per parameter group (one entry for whole-model modes)."""
        return {"model": self.name}

    def details(self) -> dict[str, Any]:
        """What this mode did to the model, for the run's started event (fp8: its layers)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"mode": self.name, "skipped": self._skipped}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what applies: a checkpoint of another mode (an A/B arm switch) is allowed,
        and then only the counters carry over."""
        self._skipped = int(state.get("skipped", 0))
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        """Undo what :meth:`prepare` did that can be undone (an A/B arm switch in a running
        job builds the next arm's policy after closing this one)."""

    def _gradients_ready(self) -> None:
        """Hook: gradients of this step are final and unscaled (adaptive measures them)."""


class BF16Policy(PrecisionPolicy):
    """bf16 autocast: fp32's exponent range, so no loss scaling is needed."""

    name = "bf16"
    compute_dtype = torch.bfloat16

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class FP16Policy(PrecisionPolicy):
    """fp16 autocast with a GradScaler: fp16 gradients underflow without the loss scale."""

    name = "fp16"
    compute_dtype = torch.float16

    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self._scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale)

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=torch.float16)


# -- fp8 -------------------------------------------------------------------------------------


def output_heads(model: nn.Module) -> set[str]:
    """The Linear layers that produce the logits, found by their role, not their name
    (traind's ``head``, Hugging Face's ``lm_head``, anyone's): one whose weight is an
    embedding's (tied), else the last Linear that maps the token embedding's width back to
    its vocabulary (the largest embedding: positions have fewer rows than tokens)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return set()
    tokens = max(embeddings, key=lambda e: e.num_embeddings)
    tied = {id(e.weight) for e in embeddings}
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = {fqn for fqn, m in linears if id(m.weight) in tied}
    shaped = [fqn for fqn, m in linears if (m.out_features, m.in_features) == (
        tokens.num_embeddings, tokens.embedding_dim)]
    return found | set(shaped[-1:])


def matmul_layers(model: nn.Module) -> dict[str, str]:
    """Every layer that multiplies by a weight matrix, by its class name: ``nn.Linear`` and
    the transposed Linear of GPT-2's blocks (transformers' ``Conv1D``), which torchao's fp8
    does not convert."""
    return {fqn: type(m).__name__ for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D"
                                             and getattr(m, "weight", None) is not None
                                             and m.weight.dim() == 2)}


def fp8_converts(head: bool, in_features: int, out_features: int, *, recipe: str,
                 emulated: bool) -> bool:
    """Whether a Linear layer becomes a torchao Float8Linear (``head``: it produces the
    logits, :func:`output_heads`).

    Never the output head: its logits feed the softmax directly, and fp8 there costs accuracy
    for little speed (torchao's and torchtitan's recipe). Never a layer whose dims are not
    multiples of 16 (fp8 matmul kernels need them). On a GPU, not the layers too small to
    gain: fp8 adds a cast and a scale per matmul, which outweighs the faster matmul below
    the sizes torchao measured on H100 (its ``_auto_filter_for_recipe``: tensorwise gains
    from K > 4096 or N > 1024; rowwise only from N > 2048 and K > 1024). Emulated (the CPU)
    there is no speed to gain or lose, so every other layer converts: emulation exists to run
    the fp8 numerics, and a small model must still have fp8 layers to show them.
    """
    if head:
        return False
    if in_features % 16 or out_features % 16:
        return False
    if emulated:
        return True
    k, n = in_features, out_features  # torchao's names: weight (N, K)
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


class FP8Policy(PrecisionPolicy):
    """torchao float8 training: Linear matmuls in fp8 (dynamic scales per tensor or per row,
    ``precision.fp8_recipe``), the rest of the forward under bf16 autocast, fp32 master
    weights. Off CUDA the matmuls run in torchao's emulation."""

    name = "fp8"
    compute_dtype = torch.bfloat16  # the Float8Linear matmuls aside, the forward runs in bf16

    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        cuda = device.type == "cuda" and torch.cuda.is_available()
        capability = torch.cuda.get_device_capability(device) if cuda else None
        reason = fp8_unsupported_reason(cuda, capability, torchao_available())
        if reason is not None:
            raise ValueError(reason)
        self.emulated = fp8_emulated(device.type)
        self.converted: list[str] = []  # the Linear layers prepare() made Float8Linear
        self.matmuls: dict[str, str] = {}  # every matmul layer, by class (prepare)

    def prepare(self, model: nn.Module) -> nn.Module:
        with quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.cfg.fp8_recipe)
        if self.emulated:
            config = dataclasses.replace(config, emulate=True)
        recipe, emulated = self.cfg.fp8_recipe, self.emulated
        heads = output_heads(model)
        self.matmuls = matmul_layers(model)

        def convert(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear):
                return True  # a container: torchao walks into it
            ok = fp8_converts(fqn in heads, module.in_features, module.out_features,
                              recipe=recipe, emulated=emulated)
            if ok:
                self.converted.append(fqn)
            return ok

        # in place: Float8Linear keeps the same weight Parameters, so build the optimizer after
        convert_to_float8_training(model, config=config, module_filter_fn=convert)
        if left := self.left_out():
            log.warning("precision.mode fp8: %d of %d matmul layers in fp8; %s stay bf16",
                        len(self.converted), len(self.matmuls),
                        ", ".join(f"{n} {kind}" for kind, n in left.items()))
        if not self.converted:
            log.warning("precision.mode fp8: no Linear layer of this model is large enough to "
                        "gain from fp8 on this GPU (%s recipe); it computes in bf16", recipe)
        return model

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def left_out(self) -> dict[str, int]:
        """The matmul layers fp8 did not convert, counted by kind: another class than
        ``nn.Linear`` (GPT-2's ``Conv1D``), the output head, or too small to gain."""
        out: dict[str, int] = {}
        for fqn, kind in self.matmuls.items():
            if fqn not in self.converted:
                key = f"{kind} layers" if kind != "Linear" else "Linear layers (the head, or "\
                    "too small to gain)"
                out[key] = out.get(key, 0) + 1
        return out

    def details(self) -> dict[str, Any]:
        return {"fp8_layers": list(self.converted), "fp8_emulated": self.emulated,
                "fp8_matmuls": len(self.matmuls), "fp8_left_out": self.left_out()}


# -- adaptive --------------------------------------------------------------------------------


def lookup_only(modules: list[nn.Module]) -> bool:
    """Whether every parameter of ``modules`` is an ``nn.Embedding``'s (a lookup, no matmul)."""
    params = {id(p) for m in modules for p in m.parameters()}
    lookups = {id(p) for m in modules for e in m.modules() if isinstance(e, nn.Embedding)
               for p in e.parameters()}
    return bool(params) and params <= lookups


def next_mode(current: str, snr: float, since_switch: int, cfg: PrecisionConfig) -> str:
    """A group's precision for the next window, from the SNR of the window just measured.

    A high SNR means the gradient's direction is consistent from step to step, so the small,
    partly systematic errors of low-precision compute cannot steer it: drop to ``cfg.low``.
    A low SNR means the signal is weak and those errors could dominate its mean: back to fp32.
    Between the thresholds nothing changes (the gap is the hysteresis), nor within
    ``min_dwell`` steps of the last switch, nor on a NaN SNR (no information).
    """
    if since_switch < cfg.min_dwell or math.isnan(snr):
        return current
    if snr > cfg.snr_high:
        return cfg.low
    if snr < cfg.snr_low:
        return "fp32"
    return current


def snr_from_moments(mean: float, var: float, count: int) -> float:
    """SNR = ``mean² / var`` of a group's gradient norm over a window of ``count`` steps.

    ``1 / SNR`` is the squared coefficient of variation of the norm: a gradient whose size
    holds steady from step to step (SNR 30: it varies by ~18%) is in a regime where the
    small errors of low-precision compute change little; one that jumps (SNR 3: ~58%) is
    where they could tip a step, so fp32. Measured on the default job (bench/
    adaptive_precision.py), this separates the phases (median ~15-30 in the first 400 steps,
    ~80-110 from step 1200 on) and the groups (block.0 lowest, the head highest), where the
    elementwise SNR of the mean gradient does not (0.6-1.0 for every group throughout: the
    mean of 16 Adam steps cancels at least as much as noise). A constant norm: inf.
    No gradient, or fewer than 2 steps: NaN (no decision).
    """
    if count < 2 or math.isnan(var):
        return math.nan
    if var > 0:
        return mean * mean / var
    return math.inf if mean > 0 else math.nan


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _shard_groups(params: list[nn.Parameter]) -> list[dist.ProcessGroup]:
    """The process groups over which the local shards of ``params`` add up to the whole.

    FSDP2 parameters are DTensors sharded over the mesh: a per-group sum over the local
    shard, summed over each sharded mesh dimension, is the sum over the whole parameter (a
    replicated dimension, as in HSDP, already holds the same values: not summed). Plain
    tensors (single, DDP, ZeRO-1: every rank holds the all-reduced gradient) need nothing.
    """
    sharded: list[Any] = [p for p in params if is_dtensor(p)]
    if not sharded:
        return []
    first = sharded[0]
    if len(sharded) != len(params) or any(
            p.device_mesh != first.device_mesh or p.placements != first.placements
            for p in sharded):
        raise ValueError("precision.mode: adaptive measures the parameters of a model that is "
                         "either wholly FSDP-sharded (one mesh, one placement) or not at all")
    return [first.device_mesh.get_group(dim) for dim, placement in enumerate(first.placements)
            if placement.is_shard()]


class SNRTracker:
    """Per group, the gradient's squared norm at every step of a window, on device.

    One fused pass per step (kernels/grad_stats.py) writes a row of per-group squared norms
    into a ``(window, groups)`` buffer; nothing is read to the host until :meth:`snr`, once
    per window. FSDP2 parameters (DTensors) are measured on their local shard: a row is then
    the shard's part of each squared norm, and the buffer is all-reduced over the shards
    before the square roots (``window x groups`` numbers per window).
    """

    def __init__(self, groups: dict[str, list[nn.Parameter]], window: int) -> None:
        self.names = list(groups)
        self.params = [p for ps in groups.values() for p in ps]
        self._reduce = _shard_groups(self.params)
        self._group_list = [i for i, ps in enumerate(groups.values()) for _ in ps]
        device = self.params[0].device if self.params else torch.device("cpu")
        # the same shape on every rank, whatever its count: the all-reduce needs that
        self._rows = torch.zeros(window, len(self.names), device=device)
        self._group_of: dict[tuple[int, ...], torch.Tensor] = {}  # by which grads exist
        self._fed = [False] * len(self.names)  # a group got some gradient in this window
        self.count = 0

    def record(self) -> None:
        """Add this step's gradients (``param.grad``, unscaled) to the window."""
        if not self.params or self.count >= len(self._rows):
            return
        grads, present = [], []
        for i, p in enumerate(self.params):
            if p.grad is not None:
                grads.append(_local(p.grad))
                present.append(i)
                self._fed[self._group_list[i]] = True
        key = tuple(present)
        if key not in self._group_of:
            self._group_of[key] = torch.tensor([self._group_list[i] for i in present],
                                               dtype=torch.long, device=self._rows.device)
        if grads:
            self._rows[self.count] = group_sq_norms(grads, self._group_of[key], len(self.names))
        self.count += 1

    def starved(self) -> list[str]:
        """Groups none of whose parameters got a gradient in this window (after 2+ steps):
        the tracker watches tensors the backward does not reach."""
        return [] if self.count < 2 else [
            name for name, fed in zip(self.names, self._fed, strict=True) if not fed]

    def snr(self) -> dict[str, float]:
        """Each group's SNR over the steps recorded since the last reset: one host read
        (and, sharded, one all-reduce: every rank calls this at the same step)."""
        rows = self._rows
        for group in self._reduce:  # local shards' parts -> the whole gradients' squares
            rows = rows.clone()
            dist.all_reduce(rows, group=group)
        n = self.count
        if n < 2 or not self.params:
            return {name: math.nan for name in self.names}
        norms = rows[:n].sqrt()  # (n, groups)
        stats = torch.stack((norms.mean(0), norms.var(0))).tolist()  # the one host read
        return {name: snr_from_moments(m, v, n)
                for name, m, v in zip(self.names, stats[0], stats[1], strict=True)}

    def reset(self) -> None:
        self._rows.zero_()
        self._fed = [False] * len(self.names)
        self.count = 0


class AdaptivePolicy(PrecisionPolicy):
    """Each block (and the head) computes in fp32 or ``cfg.low`` as its gradient SNR decides.

    The block's forward runs inside an autocast context that a forward pre-hook enters and a
    forward hook (``always_call``: also on an exception) leaves, so the model's code is
    untouched and backward follows the dtypes autograd recorded. The residual stream stays
    fp32 between blocks (a low-precision branch added to fp32 promotes to fp32).

    The embedding stays fp32 and is not measured: a lookup does no matmul, and autocast would
    not change it, so there is no decision to make. It is found by its type (a group whose
    every parameter is an ``nn.Embedding``'s: traind's ``embed``, Hugging Face's
    ``model.embed_tokens``), not its name: a factory's embedding was once measured and
    switched. The head may switch: under the global bf16/fp16 modes it runs in low precision
    too, and the loss is computed from fp32-cast logits either way.

    Windows close at steps that are multiples of ``snr_window`` (the same step on every rank,
    where a sharded model all-reduces its sums). The tracker binds to the parameters on the
    first step's gradients, not in :meth:`prepare`: FSDP's ``fully_shard`` replaces every
    parameter with a sharded DTensor after prepare, and the old ones never get a gradient.
    """

    name = "adaptive"

    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        if cfg.low == "fp16":  # fp16 groups need loss scaling; harmless for fp32 groups
            self._scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale)
        self._modes: dict[str, str] = {}
        self._last_switch: dict[str, int] = {}  # step of each group's last switch (0 = start)
        self._last_snr: dict[str, float] = {}
        self._snr_step = 0  # the step at which the window behind _last_snr closed
        self._measured: dict[str, list[nn.Module]] = {}  # group -> modules, set by prepare
        self._tracker: SNRTracker | None = None
        self._contexts: list[AbstractContextManager[Any]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._stage_group: dist.ProcessGroup | None = None  # set by split_over_stages

    def prepare(self, model: nn.Module) -> nn.Module:
        groups = layer_groups(model)
        for name, modules in groups.items():
            self._modes.setdefault(name, "fp32")  # load_state_dict may have come first
            if lookup_only(modules):
                continue
            # The head group casts only the head's matmul; its final norm is cheap and
            # normalising in fp32 keeps the logits' input exact.
            module = modules[-1]  # the block itself, or the head (not its norm)
            self._handles += [
                module.register_forward_pre_hook(self._enter_hook(name)),
                module.register_forward_hook(self._exit_hook, always_call=True),
            ]
            self._measured[name] = modules
        return model

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._measured.clear()
        self._tracker = None

    def split_over_stages(self, stage: nn.Module, group: dist.ProcessGroup) -> None:
        """Measure and decide only the groups whose layers ``stage`` holds (another stage's
        blocks never get a gradient here), and share each window's figures and switches
        over ``group`` (the pipeline's ranks, one per stage): every rank then knows every
        group's mode and SNR, so the lead rank reports the whole model and a checkpoint
        holds every stage's modes. One gather of a few numbers per group, once a window."""
        held = {id(p) for p in stage.parameters()}
        self._measured = {name: modules for name, modules in self._measured.items()
                          if any(id(p) in held for m in modules for p in m.parameters())}
        self._stage_group = group

    def _enter_hook(self, group: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            mode = self._modes[group]
            # enabled=False for fp32 groups also shields them from any outer autocast
            ctx = torch.autocast(self.device.type, dtype=_DTYPES.get(mode, torch.bfloat16),
                                 enabled=mode != "fp32")
            ctx.__enter__()
            self._contexts.append(ctx)
        return hook

    def _exit_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def _gradients_ready(self) -> None:
        if self._tracker is None:
            if not self._measured:
                raise RuntimeError("AdaptivePolicy.prepare(model) was not called")
            # the modules' parameters now: after any wrapping (fully_shard) that replaced them
            self._tracker = SNRTracker({
                name: [p for m in modules for p in m.parameters() if p.requires_grad]
                for name, modules in self._measured.items()}, self.cfg.snr_window)
        self._tracker.record()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        stepped = super().step(optimizer)
        if not stepped and self._tracker is not None:
            # inf/NaN gradients are in the window now: start it again without them
            self._tracker.reset()
        return stepped

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        super().skip(optimizer)
        if self._tracker is not None:  # the dropped gradients are in the window: start again
            self._tracker.reset()

    def after_step(self, step: int) -> list[Switch]:
        tracker = self._tracker
        if tracker is None or step % self.cfg.snr_window:
            return []
        snrs, starved = tracker.snr(), tracker.starved()
        tracker.reset()
        if starved:  # a NaN SNR forever would leave the policy silently inert
            raise RuntimeError(
                f"precision.mode adaptive: no gradient reached {', '.join(starved)} in the "
                f"window ending at step {step}; the SNR tracker watches parameters the "
                "backward does not update (was the model re-wrapped after prepare?)")
        switches = []
        for group, snr in snrs.items():
            before = self._modes[group]
            since = step - self._last_switch.get(group, 0)
            after = next_mode(before, snr, since, self.cfg)
            if after != before:
                self._modes[group], self._last_switch[group] = after, step
                switches.append(Switch(group=group, before=before, after=after, snr=snr))
        if self._stage_group is not None:  # every stage's figures and switches, on every rank
            snrs, switches = self._share(snrs, switches)
        self._last_snr, self._snr_step = snrs, step
        return switches

    def _share(self, snrs: dict[str, float], switches: list[Switch]
               ) -> tuple[dict[str, float], list[Switch]]:
        """The window's SNRs and switches of every stage (each decided its own groups);
        this rank takes the others' modes as they now are, for reports and checkpoints."""
        mine = {"snr": snrs, "switches": switches, "modes": {g: self._modes[g] for g in snrs},
                "last_switch": {g: self._last_switch[g] for g in snrs
                                if g in self._last_switch}}
        stages: list[Any] = [None] * dist.get_world_size(self._stage_group)
        dist.all_gather_object(stages, mine, group=self._stage_group)
        all_snrs: dict[str, float] = {}
        all_switches: list[Switch] = []
        for part in stages:  # in stage order: the groups in model order
            all_snrs.update(part["snr"])
            all_switches += part["switches"]
            self._modes.update(part["modes"])
            self._last_switch.update(part["last_switch"])
        return all_snrs, all_switches

    def modes(self) -> dict[str, str]:
        return dict(self._modes)

    def last_snr(self) -> dict[str, float]:
        """Each measured group's SNR over the last complete window (empty before the first)."""
        return dict(self._last_snr)

    @property
    def snr_step(self) -> int:
        """The step at which the window behind :meth:`last_snr` closed (0: none yet)."""
        return self._snr_step

    def state_dict(self) -> dict[str, Any]:
        # The partial window's norms are not saved: a resumed run starts a fresh window,
        # which delays the next decision by at most snr_window steps.
        return {**super().state_dict(), "modes": dict(self._modes),
                "last_switch": dict(self._last_switch), "last_snr": dict(self._last_snr),
                "snr_step": self._snr_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._modes.update(state.get("modes", {}))
        self._last_switch.update(state.get("last_switch", {}))
        self._last_snr = dict(state.get("last_snr", {}))
        self._snr_step = int(state.get("snr_step", 0))


# -- factory ---------------------------------------------------------------------------------

POLICIES: dict[str, type[PrecisionPolicy]] = {
    cls.name: cls for cls in (PrecisionPolicy, BF16Policy, FP16Policy, FP8Policy, AdaptivePolicy)
}


def build_policy(cfg: PrecisionConfig, device: torch.device) -> PrecisionPolicy:
    """The policy ``cfg.mode`` names; ``ValueError`` when it cannot run on ``device``."""
    try:
        cls = POLICIES[cfg.mode]
    except KeyError:
        raise ValueError(f"precision.mode: unknown mode {cfg.mode!r}; "
                         f"one of {sorted(POLICIES)}") from None
    return cls(cfg, device)

