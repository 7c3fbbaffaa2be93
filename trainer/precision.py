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
from torch import nn

from traind.extras import available, install_hint
from traind.kernels import _dispatch as kernel_dispatch
from traind.kernels.grad_stats import welford_update
from traind.trainer.model import layer_groups

if TYPE_CHECKING:
    from collections.abc import Iterator

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

    def prepare(self, model: nn.Module) -> nn.Module:
        """Adapt the (unwrapped) model in place, once, before the optimizer and DDP see it."""
        return model

    def autocast(self) -> AbstractContextManager[Any]:
        """Context for the forward pass (training and evaluation)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled when there is a scaler)."""
        (loss if self._scaler is None else self._scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale; call after the last backward, before clipping
        (clipping a scaled gradient would clip at ``scale * max_norm``). Idempotent per step."""
        if self._unscaled:
            return
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)
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


def fp8_unsupported_reason(cuda_available: bool, capability: tuple[int, int] | None,
                           torchao_available: bool) -> str | None:
    """Why fp8 training cannot run here, or None when it can.

    ``cuda_available``: the job's device is a CUDA GPU. fp8 tensor cores arrived with compute
    capability 8.9 (Ada) and 9.0 (Hopper); torchao's Float8Linear is what drives them. Off
    CUDA, torchao emulates the fp8 matmuls (casts to fp8 and back, then an fp32 matmul): the
    same numerics, no speed, for tests and CPU-only nodes (:func:`fp8_emulated`).
    """
    if not torchao_available:
        return ("precision.mode: fp8 needs torchao (torchao's float8 training): "
                f"{install_hint('torchao')}")
    if not cuda_available or (capability is not None and capability >= (8, 9)):
        return None
    cc = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
    return ("precision.mode: fp8 needs an NVIDIA GPU with compute capability 8.9+ "
            f"(Ada/Hopper) for its fp8 tensor cores; this GPU has compute capability {cc}")


def fp8_emulated(device_type: str) -> bool:
    """fp8 runs in torchao's emulation: anywhere but CUDA (there are no fp8 kernels)."""
    return device_type != "cuda"


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """torchao's import logs a warning for each CUDA extension it cannot load (all of them on
    a CPU build of torch) and torch one for its deprecated Enum registration: noise on every
    run that says nothing about this one. Raised to ERROR for the import only."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_available() -> bool:
    """torchao's float8 training can be imported (finding it imports torchao itself)."""
    with _quiet_torchao_import():
        return available("torchao.float8")


def fp8_converts(fqn: str, in_features: int, out_features: int, *, recipe: str,
                 emulated: bool) -> bool:
    """Whether the Linear layer ``fqn`` becomes a torchao Float8Linear.

    Never the output head: its logits feed the softmax directly, and fp8 there costs accuracy
    for little speed (torchao's and torchtitan's recipe). Never a layer whose dims are not
    multiples of 16 (fp8 matmul kernels need them). On a GPU, not the layers too small to
    gain: fp8 adds a cast and a scale per matmul, which outweighs the faster matmul below
    the sizes torchao measured on H100 (its ``_auto_filter_for_recipe``: tensorwise gains
    from K > 4096 or N > 1024; rowwise only from N > 2048 and K > 1024). Emulated (the CPU)
    there is no speed to gain or lose, so every other layer converts: emulation exists to run
    the fp8 numerics, and a small model must still have fp8 layers to show them.
    """
    if fqn == "head" or fqn.endswith(".head"):
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

    def prepare(self, model: nn.Module) -> nn.Module:
        with _quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.cfg.fp8_recipe)
        if self.emulated:
            config = dataclasses.replace(config, emulate=True)
        recipe, emulated = self.cfg.fp8_recipe, self.emulated

        def convert(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear):
                return True  # a container: torchao walks into it
            ok = fp8_converts(fqn, module.in_features, module.out_features, recipe=recipe,
                              emulated=emulated)
            if ok:
                self.converted.append(fqn)
            return ok

        # in place: Float8Linear keeps the same weight Parameters, so build the optimizer after
        convert_to_float8_training(model, config=config, module_filter_fn=convert)
        if not self.converted:
            log.warning("precision.mode fp8: no Linear layer of this model is large enough to "
                        "gain from fp8 on this GPU (%s recipe); it computes in bf16", recipe)
        return model

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def details(self) -> dict[str, Any]:
        return {"fp8_layers": list(self.converted), "fp8_emulated": self.emulated}


# -- adaptive --------------------------------------------------------------------------------


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


def snr_from_moments(signal: float, noise: float) -> float:
    """SNR = ``signal / noise`` with ``signal = ||mean_t g||^2`` and ``noise = sum var_t(g)``.

    A constant gradient has no noise: inf. A group with no gradient at all: NaN (no decision).
    Zero-mean noise gives about 1/window: the mean of n noisy steps keeps 1/n of the variance.
    """
    if noise > 0:
        return signal / noise
    return math.inf if signal > 0 else math.nan


class SNRTracker:
    """Per-group gradient mean and variance over steps (elementwise, Welford), on device.

    Every parameter of every group is updated by the same few fused foreach ops per step; the
    per-group sums are reduced and read to the host once, in :meth:`snr`.
    """

    def __init__(self, groups: dict[str, list[nn.Parameter]]) -> None:
        self.names = list(groups)
        self.params = [p for ps in groups.values() for p in ps]
        # which group each parameter belongs to, to sum per-parameter norms per group
        self._group_of = torch.tensor([i for i, ps in enumerate(groups.values()) for _ in ps],
                                      dtype=torch.long, device=self._device())
        self._mean = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self._m2 = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self._zeros: dict[int, torch.Tensor] = {}  # stand-ins for parameters without a grad
        # CUDA: the fused kernel leaves each group's (sum mean², sum M2) here as it updates
        self._sums: torch.Tensor | None = None
        self.count = 0

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def record(self) -> None:
        """Add this step's gradients (``param.grad``, unscaled) to the running moments."""
        if not self.params:
            return
        grads = [p.grad.float() if p.grad is not None else self._zero(i, p)
                 for i, p in enumerate(self.params)]
        self.count += 1
        if kernel_dispatch.use_triton(self._mean[0]):
            # one pass over every gradient (kernels/grad_stats.py) instead of four foreach passes
            self._sums = welford_update(grads, self._mean, self._m2, self.count,
                                        self._group_of, len(self.names))
            return
        delta = torch._foreach_sub(grads, self._mean)  # g - mean_{n-1}
        torch._foreach_add_(self._mean, delta, alpha=1.0 / self.count)
        delta_new = torch._foreach_sub(grads, self._mean)  # g - mean_n
        torch._foreach_addcmul_(self._m2, delta, delta_new)  # M2 += (g-m_{n-1})(g-m_n)

    def _zero(self, i: int, p: torch.Tensor) -> torch.Tensor:
        if i not in self._zeros:
            self._zeros[i] = torch.zeros_like(p, dtype=torch.float32)
        return self._zeros[i]

    def snr(self) -> dict[str, float]:
        """Each group's SNR over the steps recorded since the last reset: one host read."""
        if self.count < 2 or not self.params:
            return {name: math.nan for name in self.names}
        g = len(self.names)
        if self._sums is not None:
            signal, m2 = self._sums.unbind()
        else:
            mean_sq = torch.stack(torch._foreach_norm(self._mean)).square()
            m2_sum = torch.stack(torch._foreach_norm(self._m2, ord=1))  # M2 >= 0: its sum
            signal = torch.zeros(g, device=mean_sq.device).index_add_(0, self._group_of, mean_sq)
            m2 = torch.zeros(g, device=mean_sq.device).index_add_(0, self._group_of, m2_sum)
        noise = m2 / (self.count - 1)  # unbiased sample variance, summed over elements
        rows = torch.stack((signal, noise)).tolist()  # the one device->host read per window
        return {name: snr_from_moments(s, n)
                for name, s, n in zip(self.names, rows[0], rows[1], strict=True)}

    def reset(self) -> None:
        torch._foreach_zero_(self._mean)
        torch._foreach_zero_(self._m2)
        self._sums = None
        self.count = 0


class AdaptivePolicy(PrecisionPolicy):
    """Each block (and the head) computes in fp32 or ``cfg.low`` as its gradient SNR decides.

    The block's forward runs inside an autocast context that a forward pre-hook enters and a
    forward hook (``always_call``: also on an exception) leaves, so the model's code is
    untouched and backward follows the dtypes autograd recorded. The residual stream stays
    fp32 between blocks (a low-precision branch added to fp32 promotes to fp32).

    The embedding stays fp32 and is not measured: a lookup does no matmul, autocast would not
    change it, and its SNR statistics would cost 2x the table's memory for no decision. The
    head may switch: under the global bf16/fp16 modes it runs in low precision too, and the
    loss is computed from fp32-cast logits either way.
    """

    name = "adaptive"
    PINNED: ClassVar[frozenset[str]] = frozenset({"embed"})

    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        if cfg.low == "fp16":  # fp16 groups need loss scaling; harmless for fp32 groups
            self._scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale)
        self._modes: dict[str, str] = {}
        self._last_switch: dict[str, int] = {}  # step of each group's last switch (0 = start)
        self._last_snr: dict[str, float] = {}
        self._tracker: SNRTracker | None = None
        self._contexts: list[AbstractContextManager[Any]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def prepare(self, model: nn.Module) -> nn.Module:
        groups = layer_groups(model)
        for name, modules in groups.items():
            self._modes.setdefault(name, "fp32")  # load_state_dict may have come first
            if name in self.PINNED:
                continue
            # The head group casts only the head's matmul; its final norm is cheap and
            # normalising in fp32 keeps the logits' input exact.
            module = modules[-1]  # the block itself, or the head (not its norm)
            self._handles += [
                module.register_forward_pre_hook(self._enter_hook(name)),
                module.register_forward_hook(self._exit_hook, always_call=True),
            ]
        self._tracker = SNRTracker({
            name: [p for m in modules for p in m.parameters() if p.requires_grad]
            for name, modules in groups.items() if name not in self.PINNED
        })
        return model

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._tracker = None  # frees the moments (2x the measured parameters)

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
            raise RuntimeError("AdaptivePolicy.prepare(model) was not called")
        self._tracker.record()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        stepped = super().step(optimizer)
        if not stepped and self._tracker is not None:
            # inf/NaN gradients are in the moments now: start the window again without them
            self._tracker.reset()
        return stepped

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        super().skip(optimizer)
        if self._tracker is not None:  # the dropped gradients are in the moments: start again
            self._tracker.reset()

    def after_step(self, step: int) -> list[Switch]:
        tracker = self._tracker
        if tracker is None or tracker.count < self.cfg.snr_window:
            return []
        self._last_snr = tracker.snr()
        tracker.reset()
        switches = []
        for group, snr in self._last_snr.items():
            before = self._modes[group]
            since = step - self._last_switch.get(group, 0)
            after = next_mode(before, snr, since, self.cfg)
            if after != before:
                self._modes[group], self._last_switch[group] = after, step
                switches.append(Switch(group=group, before=before, after=after, snr=snr))
        return switches

    def modes(self) -> dict[str, str]:
        return dict(self._modes)

    def last_snr(self) -> dict[str, float]:
        """Each measured group's SNR over the last complete window (empty before the first)."""
        return dict(self._last_snr)

    def state_dict(self) -> dict[str, Any]:
        # The partial window's moments are not saved (2x the parameters): a resumed run starts
        # a fresh window, which delays the next decision by at most snr_window steps.
        return {**super().state_dict(), "modes": dict(self._modes),
                "last_switch": dict(self._last_switch), "last_snr": dict(self._last_snr)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._modes.update(state.get("modes", {}))
        self._last_switch.update(state.get("last_switch", {}))
        self._last_snr = dict(state.get("last_snr", {}))


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

