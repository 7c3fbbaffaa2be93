"""A run's way back: writing checkpoints, resuming from the newest, and rolling back to it.

A checkpoint holds every piece of state a step depends on (weights, optimizer, sampler, every
rank's RNG, the precision policy's and the compression hook's state, the numerics guard's
window), so a resumed job continues as the uninterrupted one would have. Files and their
layout are :mod:`traind.trainer.checkpoint`'s; here is what goes into them and when.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from traind.contracts.events import LifecycleEvent, NumericsEvent
from traind.trainer import distributed
from traind.trainer.checkpoint import (
    checkpoint_path,
    is_sharded,
    latest,
    load_checkpoint,
    load_sharded,
    save_checkpoint,
    save_sharded,
)
from traind.trainer.numerics import NumericsError

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from torch import nn

    from traind.contracts.events import Event
    from traind.trainer.compression import CompressionHook
    from traind.trainer.config import TrainConfig
    from traind.trainer.distributed import DistInfo
    from traind.trainer.numerics import Finding, NumericsGuard
    from traind.trainer.parallel import Strategy
    from traind.trainer.pipeline import DataPipeline
    from traind.trainer.precision import PrecisionPolicy


class Recovery:
    """The checkpoints of one call of ``train``: the last one written, the step it was
    written at, and the rollbacks made since. Every method is collective: all ranks call it
    at the same step. The precision policy is passed in, since an A/B arm swaps it."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, *, model: nn.Module,
                 optimizer: torch.optim.Optimizer, strategy: Strategy, data: DataPipeline,
                 hook: CompressionHook | None, numerics: NumericsGuard | None,
                 emit: Callable[[Event], None]) -> None:
        self.cfg, self.info, self.model, self.optimizer = cfg, info, model, optimizer
        self.strategy, self.data, self.hook, self.numerics = strategy, data, hook, numerics
        self.emit = emit
        self.out_dir: Path | None = cfg.job.out_dir
        self.sharded = strategy.sharded or cfg.parallel.sharded_checkpoints
        self.last_checkpoint: str | None = None
        self.written_at = -1  # the step of the state on disk (-1: none from this call)
        self.rollbacks = 0  # since the last checkpoint written
        if cfg.numerics.policy == "rollback" and self.out_dir is None:
            raise ValueError("numerics.policy: rollback restores the last checkpoint, so it "
                             "needs job.out_dir")

    def resume(self, precision: PrecisionPolicy) -> tuple[int, Path | None]:
        """Load the newest complete checkpoint in ``out_dir``; the step to continue from,
        and the checkpoint (None: a fresh start, at step 0).

        A single-file checkpoint holds the full state, so it resumes on any number of ranks;
        a sharded one is resharded by torch.distributed.checkpoint."""
        if not (self.cfg.job.resume and self.out_dir is not None):
            return 0, None
        path = latest(self.out_dir)
        if path is None:
            return 0, None
        self.written_at = self._restore(path, precision)
        return self.written_at, path

    def checkpoint(self, step: int, precision: PrecisionPolicy) -> None:
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
            "precision_modes": precision.modes(),
            "strategy": self.strategy.name,
            "config": self.cfg.model_dump(mode="json"),
            "precision": precision.state_dict(),
            # Per rank: error-feedback residuals are each rank's own debt.
            "compression": distributed.all_gather(
                self.hook.state_dict() if self.hook else None, self.info),
            "numerics": self.numerics.state_dict() if self.numerics else None,
        }
        if self.sharded:
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
        self.written_at = step
        self.rollbacks = 0  # past the trouble: rollbacks count afresh from here
        if self.info.rank == 0:
            self.emit(LifecycleEvent(rank=0, phase="checkpoint", step=step, detail={
                "path": self.last_checkpoint, "seconds": time.perf_counter() - t0,
                "sharded": self.sharded}))

    def rollback(self, step: int, finding: Finding, precision: PrecisionPolicy) -> int:
        """Restore the last checkpoint, keeping the data position: the batches trained on
        since it (the offending ones among them) are skipped, as PaLM did for its loss spikes
        (restart ~100 steps back, skip a few hundred batches). The step to continue from."""
        assert self.out_dir is not None  # checked in __init__
        path = latest(self.out_dir)
        if path is None:
            raise NumericsError(f"numerics: rollback at step {step} found no complete "
                                f"checkpoint in {self.out_dir}")
        sampler = self.data.state_dict()
        resume = self._restore(path, precision)
        self.data.load_state_dict(sampler)
        self.rollbacks += 1
        self.written_at = resume  # the state on disk is the state trained from again
        self.emit(NumericsEvent(rank=self.info.rank, step=step, action="rollback",
                                reason=finding.reason, value=finding.value,
                                limit=finding.limit, resume_step=resume,
                                skipped_batches=step - resume))
        return resume

    def _restore(self, path: Path, precision: PrecisionPolicy) -> int:
        """Load every piece of state a checkpoint holds; the step it was written at."""
        if is_sharded(path):
            model_state, opt_state = self.strategy.sharded_state(self.model, self.optimizer)
            state = {"model": model_state, "optim": opt_state}
            extra = load_sharded(path, state)
            self.strategy.load_sharded_state(self.model, self.optimizer, state["model"],
                                             state["optim"])
        else:
            extra = load_checkpoint(path)
            if self.sharded:
                raise ValueError(f"{path} is a single-file checkpoint, but strategy "
                                 f"{self.strategy.name} resumes from sharded ones only")
            self.strategy.load_full_state(self.model, self.optimizer, extra["model"],
                                          extra["optimizer"])
        self.data.load_state_dict(extra["sampler"])
        if self.numerics is not None:
            self.numerics.load_state_dict(extra.get("numerics"))
        if "precision" in extra:
            precision.load_state_dict(extra["precision"])
        hooks = extra.get("compression") or []
        if self.hook is not None and len(hooks) == self.info.world_size and hooks[self.info.rank]:
            self.hook.load_state_dict(hooks[self.info.rank])
        rngs = extra["rng"]
        if len(rngs) == self.info.world_size:
            _set_rng_state(rngs[self.info.rank])
        # else: a restart at another world size; dropout masks simply differ from an
        # uninterrupted run (the data order does not: the sampler state is the batch index)
        return int(extra["step"])


def _rng_state(cuda: Any = None) -> dict[str, torch.Tensor]:
    """The CPU generator's state and, once CUDA is in use, the current GPU's. ``cuda``:
    ``torch.cuda`` (default) or a stand-in (tests)."""
    cuda = cuda or torch.cuda
    state = {"cpu": torch.get_rng_state()}
    if cuda.is_available() and cuda.is_initialized():
        state["cuda"] = cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor], cuda: Any = None) -> None:
    cuda = cuda or torch.cuda
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and cuda.is_available():
        with contextlib.suppress(RuntimeError):
            cuda.set_rng_state(state["cuda"])
