"""Shared pieces for the trainer tests: tiny configs that train in well under a second."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)  # 2 cores here; the suite is many tiny runs, not one big one


def tiny_config(out_dir: Path | None = None, **job: Any) -> TrainConfig:
    """A 2-layer, 32-wide model on 100 kB of the standard library."""
    return TrainConfig.model_validate({
        "job": {"steps": 60, "batch_size": 4, "eval_every": 20, "eval_batches": 2,
                "checkpoint_every": 20, "threads": 1, "out_dir": out_dir, **job},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000},
        "optim": {"warmup_steps": 5, "lr": 1e-2},
        "telemetry": {"every": 1},
    })


@pytest.fixture
def make_config() -> Callable[..., TrainConfig]:
    """``make_config(out_dir, **job_overrides)`` (a fixture: test folders have no packages to
    import shared helpers from)."""
    return tiny_config
