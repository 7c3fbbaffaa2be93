"""Interleaved A/B arms inside one running job.

Arms alternate in blocks of ``interleave.block_steps`` steps in a balanced order: rounds of
every arm, each round the reverse of the one before (A B | B A | A B ...; with three arms
A B C | C B A | ...). A slow drift of the machine's speed then lands on every arm alike, and
consecutive blocks pair up for the paired statistics in ``daemon/stats.py``. The first
``warmup_steps`` of each block are left out of its measurement: caches, allocator and (for a
compression switch) the error-feedback state settle there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traind.trainer.config import ArmConfig, InterleaveConfig


def arm_index(block: int, n_arms: int) -> int:
    """The arm that runs block ``block`` (0-based): forward rounds and reversed rounds."""
    rnd, pos = divmod(block, n_arms)
    return pos if rnd % 2 == 0 else n_arms - 1 - pos


@dataclass(frozen=True, slots=True)
class BlockResult:
    arm: str
    block: int
    step: int  # the block's last step
    steps: int
    tokens: int
    seconds: float
    loss: float


class Schedule:
    """Which arm runs a step, and each block's measurement as the steps go by."""

    def __init__(self, cfg: InterleaveConfig) -> None:
        self.cfg = cfg
        self._reset(block=-1)

    def arm_for(self, step: int) -> tuple[ArmConfig, bool]:
        """The arm of optimizer step ``step`` (1-based), and whether a block starts there."""
        block = (step - 1) // self.cfg.block_steps
        arm = self.cfg.arms[arm_index(block, len(self.cfg.arms))]
        starts = block != self._block
        if starts:
            self._reset(block)
        return arm, starts

    def record(self, step: int, *, seconds: float, tokens: int, loss: float | None
               ) -> BlockResult | None:
        """One finished step; at the block's last step, its result."""
        in_block = (step - 1) % self.cfg.block_steps
        if in_block >= self.cfg.warmup_steps:
            self._steps += 1
            self._tokens += tokens
            self._seconds += seconds
        if loss is not None:
            self._losses.append(loss)
        if in_block != self.cfg.block_steps - 1:
            return None
        arm = self.cfg.arms[arm_index(self._block, len(self.cfg.arms))]
        mean_loss = sum(self._losses) / len(self._losses) if self._losses else math.nan
        return BlockResult(arm=arm.name, block=self._block, step=step, steps=self._steps,
                           tokens=self._tokens, seconds=self._seconds, loss=mean_loss)

    def _reset(self, block: int) -> None:
        self._block = block
        self._steps = self._tokens = 0
        self._seconds = 0.0
        self._losses: list[float] = []
