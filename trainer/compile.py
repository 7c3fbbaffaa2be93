"""``job.compile``: each transformer block's forward through ``torch.compile``, as torchtitan's
``apply_compile`` does, with a fallback to eager that keeps the job alive.

What is compiled is each block's ``forward`` (an instance attribute over the class's method),
not the module's call: the module's forward hooks stay outside the compiled region and run
eagerly around it. Those are FSDP2's unshard/reshard hooks and adaptive precision's autocast
enter/exit pair (an autocast entered in one hook and left in another cannot be traced inside
one graph). The module tree is untouched: ``model.blocks`` is still a ModuleList of ``Block``,
so ``fully_shard``, ``layer_groups`` and checkpoint keys see what they saw without compile.
Activation checkpointing wraps the block *call* (trainer/model.py), so its recompute in
backward calls the same compiled forward again.

One compiled function serves every block (they share ``Block.forward``'s code; dynamo guards
on the module), so a 6-layer model compiles once per grad mode (training, then evaluation
under ``no_grad``), not six times.

A compile failure (an unsupported op, a backend that raises, a missing C++ compiler) shows at
the first call. Then every block goes back to eager, one warning says why, and the call that
failed is answered by the eager forward: the job continues. The backward graph is compiled
with the forward (not lazily at the first backward, torch's default) so that its failure is
caught at the same place rather than in the middle of DDP's or FSDP's backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch._functorch.config as functorch_config
from torch import nn

log = logging.getLogger("traind")

# On the CPU a compile costs tens of seconds and pays back only on large enough steps.
# Measured on the 2-core shared test machine (inductor, 2 threads, eager and compiled steps
# alternated in one process; cold = an empty inductor cache):
#   default model (4 x 128, seq 128, batch 8; 6 GFLOP/step): cold compile 53 s, steps 0.153 s
#     eager vs 0.126 s compiled (1.23x): a cold compile pays back after ~2000 steps;
#   bench shape (6 x 256, 8 heads, seq 256, batch 16; 139 GFLOP/step): cold compile 35 s,
#     7.7 s vs 3.7 s (1.8x): it pays back within 10 steps;
#   the test suite's shared model (2 x 64, seq 64, batch 8; 0.43 GFLOP/step): cold compile
#     54 s, 0.078 s eager vs 0.125 s compiled (0.91x): compile never pays there.
# A warm inductor cache (the same shapes compiled before on this machine) takes ~5 s.
# "auto" on the CPU: steps of at least CPU_MIN_STEP_FLOPS (below the default model's, above
# the suite's) and jobs of at least CPU_MIN_JOB_FLOPS of training, twice the cold break-even
# at the default model (~2000 steps x 6 GFLOP = 12 TFLOP), so a job compiles where it gains
# at least what the compile costs. Counted in FLOPs, not steps, because the gain grows with
# the step: the bench shape pays back within 10 steps, and compiles from ~170. The default
# job (2000 steps, 12 TFLOP) stays eager on the CPU and trains from its first second.
CPU_MIN_STEP_FLOPS = 4e9
CPU_MIN_JOB_FLOPS = 24e12

Backend = str | Callable[..., Any]
# The compiler the loop's jobs use: torch's default. A seam for tests, which set a failing one
# (the fallback) or "aot_eager" (dynamo and AOTAutograd without inductor's C++ build, which
# costs a minute per cold compile on a 2-core machine).
BACKEND: Backend = "inductor"


def should_compile(setting: bool | Literal["auto"], device_type: str, *, steps: int,
                   step_flops: float) -> tuple[bool, str]:
    """Whether to compile, and why (for the started event and the log).

    ``setting`` is ``job.compile``; ``step_flops`` the training FLOPs of one optimizer step on
    one rank (flops per token x tokens per step). CUDA: always worth it under auto (minutes of
    training per compile, and fused kernels are most of what compile buys there).
    """
    if setting is True:
        return True, "job.compile = true"
    if setting is False:
        return False, "job.compile = false"
    if device_type == "cuda":
        return True, "auto: CUDA"
    if step_flops < CPU_MIN_STEP_FLOPS:
        return False, (f"auto: CPU steps of {step_flops / 1e9:.2g} GFLOP are below "
                       f"{CPU_MIN_STEP_FLOPS / 1e9:.2g}, where compile stops paying")
    if steps * step_flops < CPU_MIN_JOB_FLOPS:
        return False, (f"auto: {steps} CPU steps ({steps * step_flops / 1e12:.3g} TFLOP) are "
                       f"too few to pay back the compile (at least "
                       f"{CPU_MIN_JOB_FLOPS / 1e12:.3g} TFLOP)")
    return True, "auto: a long CPU job of large steps"


@dataclass(slots=True)
class CompiledBlocks:
    """The blocks whose forward is compiled; :meth:`fall_back` turns them all back to eager."""

    blocks: list[nn.Module]
    on_fallback: Callable[[str], None] | None = None
    failure: str | None = None  # why compile was given up, once it was

    @property
    def active(self) -> bool:
        """Compiled forwards are in use (no failure so far)."""
        return self.failure is None

    def fall_back(self, exc: BaseException) -> None:
        if self.failure is not None:
            return
        self.failure = describe(exc)
        for block in self.blocks:
            block.__dict__.pop("forward", None)  # the class's eager forward again
        log.warning("job.compile: torch.compile failed (%s); the blocks run eagerly",
                    self.failure)
        if self.on_fallback is not None:
            self.on_fallback(self.failure)

    def remove(self) -> None:
        """Undo the compile (the blocks' eager forward again), without a warning."""
        for block in self.blocks:
            block.__dict__.pop("forward", None)


def describe(exc: BaseException) -> str:
    """One line for a compile failure: dynamo's exception and, under it, what the backend (or
    the op it met) raised, e.g. ``BackendCompilerFailed (RuntimeError: ...)``."""
    root, seen = exc, {id(exc)}
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        if id(inner) in seen:  # a cycle of causes: stop where it closes
            break
        root = inner
        seen.add(id(root))

    def first_line(e: BaseException) -> str:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return lines[0] if lines else ""

    if root is exc:
        return f"{type(exc).__name__}: {first_line(exc)}"[:500]
    return f"{type(exc).__name__} ({type(root).__name__}: {first_line(root)})"[:500]


def compile_blocks(model: nn.Module, *, backend: Backend | None = None,
                   on_fallback: Callable[[str], None] | None = None) -> CompiledBlocks:
    """Compile the forward of each block of ``model.blocks`` in place (torchtitan's per-block
    compile, ``fullgraph=True``: a graph break is a failure, and falls back, rather than a
    silently slower split graph). Call after precision's ``prepare`` (fp8 swaps the Linear
    layers the graphs capture) and before the parallel wrap. ``backend`` is the seam tests
    use to inject a failing compiler (None: :data:`BACKEND`)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"job.compile needs a model with .blocks (a ModuleList); "
                        f"{type(model).__name__} has none")
    state = CompiledBlocks(blocks=list(blocks), on_fallback=on_fallback)
    for block in state.blocks:
        eager = block.forward  # the bound class method
        compiled = torch.compile(eager, backend=backend or BACKEND, fullgraph=True)
        # an instance attribute shadows the class's forward; nn.Module.__call__ finds it
        block.__dict__["forward"] = _guarded(state, eager, compiled)
    return state


def _guarded(state: CompiledBlocks, eager: Callable[..., Any],
             compiled: Callable[..., Any]) -> Callable[..., Any]:
    # Imported only once something compiles: torch._dynamo adds 1.3 s to a process's start.
    from torch._dynamo.exc import TorchDynamoException

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not state.active:  # another block failed first
            return eager(*args, **kwargs)
        try:
            # Non-lazy backward: compile the backward graph now, where a failure is caught
            # (torch's default compiles it at the first backward, past this try).
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                return compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            # The compiler's own failures (dynamo's Unsupported, BackendCompilerFailed and
            # inductor's errors under it). Anything else passes through untouched: an error
            # of the block itself (dynamo re-raises it as eager would), and the control flow
            # of others, such as activation checkpointing's early stop of a recompute (an
            # exception raised from its saved-tensor hook, through this call). A failure
            # that eager shares still raises, from the eager call here.
            out = eager(*args, **kwargs)
            state.fall_back(exc)
            return out
    return forward
