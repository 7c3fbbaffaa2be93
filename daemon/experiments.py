"""Interleaved A/B experiments on this node: from a user's spec to a job, and back to a view.

An interleaved experiment is one job whose arms alternate in blocks (trainer/interleave.py).
Its experiment row, arms and one trial per arm live in the queue tables like any other
experiment; the node claims those trials for the job (owner ``run:<id>``, so the run is
found from the experiment) and completes them with each arm's blocks when the job ends.
"""

from __future__ import annotations

from typing import Any

from traind.daemon.config import Settings, assign, train_config, validate
from traind.daemon.queue import ExperimentView, TrialView
from traind.daemon.service import ExperimentInfo, ExperimentSpec
from traind.trainer.config import TrainConfig

OWNER_PREFIX = "run:"
# The job holds its trials for its whole life; nothing else claims interleaved trials.
LEASE_SECONDS = 30 * 24 * 3600.0


def experiment_config(settings: Settings, spec: ExperimentSpec) -> TrainConfig:
    """The job that runs ``spec``: this node's config, the spec's overrides, its arms.
    ``ConfigError`` names every bad field (``overrides.model.n_layers``, ``interleave...``)."""
    tree: dict[str, Any] = train_config(settings, default_out_dir=settings.daemon.var_dir
                                        ).model_dump(mode="json")
    tree["job"].pop("out_dir", None)  # each run gets its own folder
    for path, value in spec.overrides.items():
        assign(tree, str(path).split("."), value, source=f"overrides.{path}")
    tree["job"] = {**tree["job"], "name": spec.name, "steps": spec.steps}
    tree["interleave"] = {"arms": [dict(a) for a in spec.arms],
                          "block_steps": spec.block_steps,
                          "warmup_steps": spec.warmup_steps,
                          "loss_margin": spec.loss_margin}
    cfg: TrainConfig = validate(tree, TrainConfig)
    return cfg


def run_of(trials: list[TrialView]) -> int | None:
    for t in trials:
        if t.lease_owner and t.lease_owner.startswith(OWNER_PREFIX):
            return int(t.lease_owner.removeprefix(OWNER_PREFIX))
    return None


def info(view: ExperimentView, trials: list[TrialView],
         live_verdict: dict[str, Any] | None = None) -> ExperimentInfo:
    return ExperimentInfo(
        id=view.id, name=view.name, state=view.state, mode=view.mode,
        arms=tuple(a["name"] for a in view.arms), run_id=run_of(trials),
        verdict=view.verdict if view.verdict is not None else live_verdict,
        config_hash=view.config_hash, versions=view.versions, created_at=view.created_at,
        finished_at=view.finished_at)
