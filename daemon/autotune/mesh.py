"""The auto-tuner's mesh dimension: the shapes (dp, tp, pp) of the job's own world size, each as
the overrides its forked trials run with, or left out with trainer/mesh.py's reason.

Pure: a validated ``TrainConfig`` in, plain tables out. The rules are trainer/mesh.py's
(``mesh_problems``, itself ``shape_problems``, ``tp_problems`` and ``pp_problems``): this module
only proposes shapes and the few overrides a shape needs to be a fair arm, and asks the rules.

A candidate's table holds dotted config paths (``parallel.dp``, ...; the ones a forked arm may
set are ``daemon/experiments/specs.py``'s ``MESH_ARM_FIELDS``):

- ``parallel.dp``, ``parallel.tp``, ``parallel.pp``: always all three, so a base config that
  gives ``parallel.dp`` explicitly cannot contradict the shape.
- ``job.batch_size`` when it changes: the arm keeps the job's **global** batch (sequences per
  optimizer step, ``job.batch_size x dp``; the tp ranks of a dp group and a pipeline's stages
  share one batch). A dp4 job and a tp4 job at the same ``job.batch_size`` would train on four
  times fewer tokens per step in the second: its tokens/s would be measured on smaller matmuls
  and its validation loss after N steps on a quarter of the data, so neither the speed nor the
  quality statistic would compare like with like. A shape whose dp does not divide the global
  batch is left out, with that reason (the tuner's own rule, not the mesh's).
- ``parallel.microbatches`` back to 0 (derived: trainer/mesh.default_microbatches, the one
  rule) when pp > 1 and the job sets fewer micro-batches than stages. 1f1b refuses fewer
  (``pp_problems``); gpipe runs them, but then a stage idles at every tick of the schedule and
  the arm is a straw man. More than pp would be a second dimension (the bubble) to tune.
- The job's ``parallel.strategy`` is kept: each of ddp, zero1, fsdp and hsdp runs on every
  shape (zero1 beside tp or pp through trainer/zero.py), so the arm differs from the baseline
  in its mesh alone.

Every arm runs compression ``none`` at the baseline's precision: the mesh stage is the tuner's
first (daemon/autotune/search.py says why), so that is the setting it varies the mesh of.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from traind.errors import line
from traind.trainer.mesh import MeshShape, mesh_problems, shape_problems

if TYPE_CHECKING:
    from traind.errors import FieldError
    from traind.trainer.config import TrainConfig


def world_size(cfg: TrainConfig) -> int:
    return cfg.job.nproc_per_node * cfg.job.nnodes


def shapes(world: int) -> list[MeshShape]:
    """Every (dp, tp, pp) whose product is ``world``, by pp, then tp: dp-only first."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [MeshShape(world // (tp * pp), tp, pp) for pp in divisors for tp in divisors
            if (world // pp) % tp == 0]


def skipped(world: int) -> str | None:
    """Why the mesh stage has nothing to try (None: it has shapes to try)."""
    if world < 2:
        return (f"the job has {world} rank (job.nproc_per_node x job.nnodes): its only mesh "
                "is dp1, so there is no other shape to try")
    return None


def label(shape: MeshShape) -> str:
    """``dp2tp2``: the degrees above 1 (``dp1`` for one rank), as arm names carry them."""
    return "".join(f"{d}{n}" for d, n in (("dp", shape.dp), ("tp", shape.tp), ("pp", shape.pp))
                   if n > 1) or "dp1"


# An arm name that ends in a shape's label (``fp32.none.dp2tp2``): a mesh candidate.
LABELLED = re.compile(r"\.(?=[dtp]p\d)(dp\d+)?(tp\d+)?(pp\d+)?$")


def _with(cfg: TrainConfig, table: dict[str, Any]) -> TrainConfig:
    """``cfg`` with the table's overrides and compression none, unvalidated: the rules read it."""
    section: dict[str, dict[str, Any]] = {"parallel": {}, "job": {}}
    for key, value in table.items():
        head, field = key.split(".", 1)
        section[head][field] = value
    return cfg.model_copy(update={
        "parallel": cfg.parallel.model_copy(update=section["parallel"]),
        "job": cfg.job.model_copy(update=section["job"]),
        "compression": cfg.compression.model_copy(update={"method": "none"})})


def _problems(cfg: TrainConfig, table: dict[str, Any]) -> list[FieldError]:
    return mesh_problems(_with(cfg, table), world=world_size(cfg))


def setting(cfg: TrainConfig, shape: MeshShape) -> tuple[dict[str, Any], list[str]]:
    """The overrides that run ``cfg`` on ``shape`` (see the module doc), and why it cannot
    (the rules' ``path: reason`` lines; empty: it can)."""
    p = cfg.parallel
    own, _ = shape_problems(p.dp, p.tp, p.pp, world_size(cfg))
    table: dict[str, Any] = {"parallel.dp": shape.dp, "parallel.tp": shape.tp,
                             "parallel.pp": shape.pp}
    global_batch = cfg.job.batch_size * (own.dp if own else 1)
    if global_batch % shape.dp:
        return table, [line(("job", "batch_size"), f"the arm keeps the job's global batch of "
                            f"{global_batch} sequences (job.batch_size x dp), which dp = "
                            f"{shape.dp} does not divide")]
    batch = global_batch // shape.dp
    if batch != cfg.job.batch_size:
        table["job.batch_size"] = batch
    if shape.pp > 1 and 0 < p.microbatches < shape.pp:  # 0: derived at the arm's shape
        table["parallel.microbatches"] = 0
    return table, [line(loc, msg) for loc, msg in _problems(cfg, table)]


def settings(cfg: TrainConfig) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """Every other shape of ``cfg``'s world size: those that run (their overrides), and those
    the rules refuse (their overrides and the reasons, joined). The job's own shape is the
    baseline, not a candidate."""
    world = world_size(cfg)
    own, _ = shape_problems(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, world)
    ok, refused = [], []
    for shape in shapes(world):
        if shape == own:
            continue
        table, why = setting(cfg, shape)
        if why:
            refused.append((table, "; ".join(why)))
        else:
            ok.append(table)
    return ok, refused


def shape_of(table: Any) -> MeshShape | None:
    """The shape a candidate's table sets (None: the job's own)."""
    if not table:
        return None
    return MeshShape(int(table["parallel.dp"]), int(table["parallel.tp"]),
                     int(table["parallel.pp"]))
