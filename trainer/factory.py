"""The user's own model: ``model.factory = "package.module:function"``.

The function is imported from the worker's environment and called with the fields of the run's
``ModelConfig`` that its parameters name (``vocab_size``, ``seq_len``, ``d_model``, ...; a
parameter called ``config`` or ``cfg`` gets the whole node), and returns an ``nn.Module`` that
maps token ids ``(B, T)`` to logits ``(B, T, V)`` (a tensor, the first of a tuple, or an
object's ``.logits`` as Hugging Face returns them), or to a loss when its forward takes the
targets by name (``targets``). The forward is called by name, never by position
(:func:`forward_call`). :class:`UserModel` wraps it so the trainer sees what it sees of its own
GPT:

- ``forward(idx, targets) -> (logits | None, loss)``;
- ``blocks``: the user's repeated layers (the longest ``ModuleList`` or ``Sequential`` of its
  tree; none: an empty list), which FSDP2 shards one by one and ``job.compile`` compiles one
  by one, as torchtitan does for its own models;
- ``layer_groups()``: the named modules telemetry and adaptive precision look at, one per
  top-level child, a repeated stack expanded per layer (``layers.0``, ``layers.1``, ...);
- ``num_params`` and ``flops_per_token``: 6·N for the non-embedding parameters, since the
  attention's own term needs shapes traind cannot read off an arbitrary model (stated in the
  run's MFU note by the trainer).

Tensor parallel takes the plan the module carries, as Hugging Face models carry their
``_tp_plan``: an attribute ``tp_plan``, a dict from module paths in the user's module (``*``
matches one name: ``"layers.*.attn.q"``) to ``"colwise"``, ``"rowwise"`` or any of PyTorch's
``ParallelStyle`` objects, applied by ``parallelize_module`` (trainer/tensor_parallel.py). The
model must compute its heads from the local shapes (``view(B, T, -1, head_dim)``), since a
column-parallel q holds ``n_heads / tp`` of them. Without a usable plan a tp job is refused by
the daemon's admission, which builds the module on the meta device in a child process
(:func:`main`), and by the worker; pipeline parallel needs a cut into stages no module carries
and is refused by the config rules (trainer/mesh.py).

Importing code is the host owner's decision: the field is settable only in the daemon's config
file and CLI (``HOST_ONLY`` in trainer/config.py; the API refuses it, daemon/experiments/
specs.py).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from traind.errors import FieldErrors
from traind.trainer.config import FACTORY_PATTERN
from traind.trainer.model import GPT

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.trainer.config import ModelConfig

_WHOLE_CONFIG = ("config", "cfg")
_LOC = ("model", "factory")


def load_factory(ref: str) -> Callable[..., Any]:
    """The function ``ref`` names; a ``FieldErrors`` at ``model.factory`` saying why not."""
    if not re.fullmatch(FACTORY_PATTERN, ref):
        raise FieldErrors.at(_LOC, f"{ref!r} is not 'package.module:function'")
    module_name, func_name = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FieldErrors.at(_LOC, f"cannot import {module_name!r} in the worker's "
                             f"environment ({exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise FieldErrors.at(_LOC, f"{module_name!r} has no function {func_name!r}")
    return func


def call_factory(func: Callable[..., Any], cfg: ModelConfig) -> nn.Module:
    """``func`` called with the config fields its parameters name; its ``nn.Module``."""
    fields = cfg.model_dump()
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(func).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in _WHOLE_CONFIG:
            kwargs[name] = cfg
        elif name in fields:
            kwargs[name] = fields[name]
        elif param.default is param.empty:
            raise FieldErrors.at(_LOC, f"{cfg.factory}'s parameter {name!r} is not a "
                                 "model.* field (nor config/cfg), and has no default")
    module = func(**kwargs)
    if not isinstance(module, nn.Module):
        raise FieldErrors.at(_LOC, f"{cfg.factory} returned {type(module).__name__}, not an "
                             "nn.Module")
    return module


def build_model(cfg: ModelConfig) -> GPT | UserModel:
    """The run's model: traind's own GPT, or the user's through ``model.factory`` or
    ``model.hf``."""
    return build_user_model(cfg) if cfg.user_field is not None else GPT(cfg)


def build_user_model(cfg: ModelConfig) -> UserModel:
    if cfg.hf is not None:
        from traind.trainer.hf import build_hf

        return UserModel(build_hf(cfg), ("model", "hf"))
    assert cfg.factory is not None
    return UserModel(call_factory(load_factory(cfg.factory), cfg))


def count_params(cfg: ModelConfig, *, tp: int = 1) -> int:
    """The factory model's parameter count, built on the meta device (no memory, no init);
    with ``tp > 1`` its plan is checked too (``FieldErrors`` naming what is wrong)."""
    with torch.device("meta"):
        model = build_user_model(cfg)
    if tp > 1:
        from traind.trainer.tensor_parallel import user_plan

        user_plan(model)
    return model.num_params()


def main() -> None:
    """``python -m traind.trainer.factory`` with ``{"model": ModelConfig, "tp": n}`` as JSON on
    stdin prints ``{"params": N}`` or ``{"errors": [[loc, msg], ...]}``: the daemon's
    admission asks here, in a child process, since the daemon imports neither torch nor the
    user's code."""
    import json
    import sys

    from traind.trainer.config import ModelConfig

    try:
        asked = json.loads(sys.stdin.read())
        out: dict[str, Any] = {"params": count_params(
            ModelConfig.model_validate(asked["model"]), tp=int(asked.get("tp", 1)))}
    except FieldErrors as exc:
        out = {"errors": [list(e) for e in exc.errors]}
    except Exception as exc:  # the user's code failed: said at the field that runs it
        loc = ModelConfig.model_validate(asked["model"]).user_field or _LOC
        out = {"errors": [[list(loc), f"building the model failed: "
                           f"{type(exc).__name__}: {exc}"]]}
    print(json.dumps(out))


def _stack(module: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """The longest ModuleList or Sequential in ``module``'s tree (the first of equals)."""
    best: tuple[str, nn.ModuleList | nn.Sequential] | None = None
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > 1 and (
                best is None or len(m) > len(best[1])):
            best = (name, m)
    return best


# What a forward's parameter for the token ids may be called; failing these, its first.
_INPUT_NAMES = ("input_ids", "idx", "tokens", "x")
# The next-token targets, passed by name only: traind's (and nanoGPT's) ``targets``. Never
# ``labels``: Hugging Face shifts labels itself, and traind's targets are shifted already.
_TARGET_NAMES = ("targets",)


@dataclass(frozen=True)
class ForwardCall:
    """How traind calls a module's forward: the token ids by ``input`` (positionally when it
    is positional-only), the targets by ``targets`` when the forward names one, and
    ``use_cache=False`` where it takes one (a training step wants no key/value cache)."""

    input: str
    positional: bool
    targets: str | None
    no_cache: bool

    def __call__(self, module: nn.Module, idx: torch.Tensor,
                 targets: torch.Tensor | None) -> Any:
        kwargs: dict[str, Any] = {"use_cache": False} if self.no_cache else {}
        if self.targets is not None and targets is not None:
            kwargs[self.targets] = targets
        if self.positional:
            return module(idx, **kwargs)
        return module(**{self.input: idx}, **kwargs)


def forward_call(module: nn.Module) -> ForwardCall:
    """How to call ``module``'s forward, read from its signature, never guessed by position:
    a wrapper ``forward(input_ids, attention_mask=None)`` once got the targets as its mask
    and trained silently wrong. ``FieldErrors`` at ``model.factory`` for a forward traind
    cannot call: no parameter for the token ids, or one it does not pass without a default."""
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    name = f"{type(module).__name__}.forward"
    if not params:
        raise FieldErrors.at(_LOC, f"{name} takes no parameter for the token ids (traind "
                             "passes them as input_ids, or as its first parameter)")
    names = [p.name for p in params]
    first = next((params[names.index(n)] for n in _INPUT_NAMES if n in names), params[0])
    targets = next((n for n in _TARGET_NAMES if n in names), None)
    missing = [p.name for p in params if p.default is p.empty
               and p.name not in (first.name, targets)]
    if missing:
        raise FieldErrors.at(_LOC, f"{name} needs {', '.join(missing)}, which traind does "
                             f"not pass: it passes the token ids (as {first.name}) and the "
                             "next tokens as `targets` where the forward has that parameter; "
                             "give the others defaults")
    return ForwardCall(first.name, first.kind == first.POSITIONAL_ONLY, targets,
                       "use_cache" in names)


def read_output(out: Any, *, with_targets: bool) -> tuple[torch.Tensor | None,
                                                          torch.Tensor | None]:
    """``(logits, loss)`` from what a forward returned: a ``(logits, loss)`` tuple (traind's
    GPT, when the forward took the targets), an object with ``.logits`` / ``.loss`` (Hugging
    Face's outputs), a tuple whose first item is the logits, logits ``(B, T, V)`` or a
    scalar loss."""
    if hasattr(out, "logits") or hasattr(out, "loss"):
        return getattr(out, "logits", None), getattr(out, "loss", None)
    if isinstance(out, tuple | list) and out:
        if with_targets and len(out) == 2:
            return out[0], out[1]
        out = out[0]
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return None, out
    if isinstance(out, torch.Tensor) and out.dim() == 3:
        return out, None
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    raise FieldErrors.at(_LOC, f"the model returned {shape}; traind reads logits (B, T, V), "
                         "a scalar loss, a (logits, loss) tuple, or an object with .logits "
                         "or .loss (as Hugging Face's outputs)")


class UserModel(nn.Module):
    """A factory's module as the trainer drives it (see the module doc)."""

    def __init__(self, inner: nn.Module, field: tuple[str, str] = _LOC) -> None:
        super().__init__()
        self.inner = inner
        self.field = field  # where a refusal of it is named: model.factory or model.hf
        found = _stack(inner)
        self._stack_name = f"inner.{found[0]}" if found else ""
        # not registered twice: a plain list attribute, the modules stay under inner
        self.__dict__["blocks"] = nn.ModuleList() if found is None else found[1]
        self._call = forward_call(inner)  # refused here (and so at admission) if unclear

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        logits, loss = read_output(self._call(self.inner, idx, targets),
                                   with_targets=self._call.targets is not None)
        if loss is None and targets is not None:
            if logits is None or logits.dim() != 3:
                raise FieldErrors.at(_LOC, "the model returned no logits (B, T, V) and no "
                                     "loss for the targets")
            b, t = targets.shape
            loss = F.cross_entropy(logits.float().view(b * t, -1), targets.reshape(b * t))
        return logits, loss

    @property
    def tp_plan(self) -> dict[str, Any]:
        """The tensor-parallel plan the user's module carries (see the module doc)."""
        plan = getattr(self.inner, "tp_plan", None)
        if not plan or not isinstance(plan, dict):
            raise FieldErrors.at(self.field, f"{type(self.inner).__name__} carries no tp_plan (a "
                                 "dict of module path -> 'colwise' | 'rowwise' | "
                                 "ParallelStyle), which parallel.tp > 1 needs")
        return plan

    def layer_groups(self) -> dict[str, list[nn.Module]]:
        return _groups(self.inner, self.__dict__["blocks"], "")

    def num_params(self, *, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        return n

    def flops_per_token(self) -> int:
        return 6 * self.num_params(non_embedding=True)


def _groups(module: nn.Module, stack: nn.ModuleList | nn.Sequential, prefix: str
            ) -> dict[str, list[nn.Module]]:
    """One group per child of ``module`` with trainable parameters; the stack's layers one
    each, and a child holding the stack opened up, so no parameter is in two groups."""
    groups: dict[str, list[nn.Module]] = {}
    for name, child in module.named_children():
        if child is stack:
            groups |= {f"{prefix}{name}.{i}": [layer] for i, layer in enumerate(stack)}
        elif any(m is stack for m in child.modules()):
            groups |= _groups(child, stack, f"{prefix}{name}.")
        elif any(p.requires_grad for p in child.parameters()):
            groups[f"{prefix}{name}"] = [child]
    return groups


if __name__ == "__main__":
    main()
