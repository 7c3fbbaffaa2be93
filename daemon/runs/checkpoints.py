"""Which checkpoint a run folder holds: read from the trainer's own file names."""

from __future__ import annotations

import re
from pathlib import Path

from traind.trainer.checkpoint import latest

_STEP_OF = re.compile(r"^(?:dcp_)?step_(\d{8})(?:\.pt)?$")


def step_of(checkpoint: Path) -> int:
    m = _STEP_OF.match(checkpoint.name)
    if m is None:
        raise ValueError(f"{checkpoint.name}: not a checkpoint name (step_<8 digits>.pt)")
    return int(m.group(1))


def has_checkpoint(out_dir: str) -> bool:
    """Whether a run folder holds a complete checkpoint (a run that has one can resume)."""
    return latest(Path(out_dir)) is not None


def checkpoint_at(out_dir: Path, step: int) -> bool:
    """Whether the newest complete checkpoint in ``out_dir`` is the one of ``step``."""
    found = latest(out_dir)
    return found is not None and step_of(found) == step
