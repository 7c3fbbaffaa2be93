"""Interleaved A/B experiments on this node: from a user's spec to a job, and back to a view.

An interleaved experiment is one job whose arms alternate in blocks (trainer/interleave.py).
Its experiment row, arms and one trial per arm live in the queue tables like any other
experiment; the node claims those trials for the job (owner ``run:<id>``, so the run is
found from the experiment) and completes them with each arm's blocks when the job ends.

A forked experiment runs each arm as a job of its own from one starting checkpoint
(``daemon/experiments/forked.py``); here its configs are checked up front, so a bad arm is
refused with its field's name before anything is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, get_args

from pydantic import BaseModel, ValidationError

from traind.daemon.config import ConfigError, Settings, assign, train_config, validate
from traind.daemon.experiments.reuse import carried_from, carried_of
from traind.daemon.service import ExperimentInfo, ExperimentSpec
from traind.trainer.checkpoint import checkpoint_path
from traind.trainer.config import HOST_ONLY, TrainConfig, compression_unavailable

if TYPE_CHECKING:
    from traind.daemon.db.queue import ExperimentView
    from traind.errors import FieldError, Loc

# The job holds its trials for its whole life; nothing else claims interleaved trials.
LEASE_SECONDS = 30 * 24 * 3600.0


MODES = ("interleaved", "forked")
# Each forked arm is a job of its own, so a precision that keeps state (fp16's loss scaler)
# is fine there, unlike in an interleaved job that switches precision at block boundaries.
FORKED_PRECISIONS = ("fp32", "bf16", "fp16")
# bucket_mb and mesh only here: DDP builds its buckets once, and a job its mesh, so an
# interleaved job cannot switch them.
_ARM_KEYS = frozenset({"name", "compression", "precision", "bucket_mb", "mesh"})
# What an arm's ``mesh`` table may set (dotted paths): the shape, and what the mesh rules or a
# fair comparison need beside it (daemon/autotune/mesh.py says when the tuner sets each).
MESH_ARM_FIELDS = frozenset({"parallel.dp", "parallel.tp", "parallel.pp", "parallel.strategy",
                             "parallel.microbatches", "job.batch_size"})


def _mentions_path(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return True
    return any(_mentions_path(arg) for arg in get_args(annotation))


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


def path_fields(model: type[BaseModel], prefix: str = "") -> frozenset[str]:
    """Dotted paths of every field of ``model`` only the host's owner may set: those whose
    type holds a ``Path`` (``job.out_dir``, ``data.paths``, ...), read from the annotations so
    a new one is covered without a list, and those marked ``HOST_ONLY`` (``model.factory``:
    an import)."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        if _mentions_path(info.annotation) or info.json_schema_extra == HOST_ONLY:
            out.add(prefix + name)
        for sub in _models_in(info.annotation):
            out |= path_fields(sub, f"{prefix}{name}.")
    return frozenset(out)


def _leaves(key: str, value: Any) -> Iterator[str]:
    """The dotted paths an override sets: ``("data", {"paths": [...]})`` sets ``data.paths``."""
    yield key
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(f"{key}.{k}", v)


def _loc(dotted_path: str) -> Loc:
    """An override's dotted key (the API's own notation, ``model.n_layers``) as a loc."""
    return tuple(int(p) if p.isdigit() else p for p in dotted_path.split("."))


def refuse_paths(overrides: Mapping[str, Any], *, where: Loc = ("overrides",)) -> None:
    """``ConfigError`` naming each override that would set a file-system path: a web user
    names checkpoints and data by ids, never paths (checkpoint loading unpickles; data
    paths read any file the daemon can). The daemon's config file and CLI may set them."""
    forbidden = path_fields(TrainConfig)
    bad = sorted({leaf for key, value in overrides.items() for leaf in _leaves(str(key), value)
                  if any(leaf == f or leaf.startswith(f + ".") for f in forbidden)})
    if bad:
        raise ConfigError([((*where, *_loc(leaf)), "a file-system path or an import cannot "
                            "be set through the API (only in the daemon's own config file or "
                            "CLI)") for leaf in bad])


def _base_tree(settings: Settings, spec: ExperimentSpec) -> dict[str, Any]:
    """This node's job config with the spec's overrides, name and steps, as a plain tree."""
    tree: dict[str, Any] = train_config(settings, default_out_dir=settings.daemon.var_dir
                                        ).model_dump(mode="json")
    tree["job"].pop("out_dir", None)  # each run gets its own folder
    refuse_paths(spec.overrides)
    for i, arm in enumerate(spec.arms):  # an arm's compression table is compression.* fields
        if isinstance(arm.get("compression"), Mapping):
            refuse_paths({"compression": arm["compression"]}, where=("arms", i))
    for path, value in spec.overrides.items():
        assign(tree, str(path).split("."), value, source=f"overrides.{path}",
               loc=("overrides", *_loc(str(path))))
    tree["job"] = {**tree["job"], "name": spec.name, "steps": spec.steps}
    return tree


def min_steps(arms: int, block_steps: int) -> int:
    """The least budget of an interleaved experiment: two full rounds (every arm one block
    each), so each arm has two pairs with the baseline, the fewest a verdict reads. Less
    would end with no verdict at all."""
    return 2 * block_steps * arms


def job_config(settings: Settings, overrides: Mapping[str, Any]) -> TrainConfig:
    """This node's job config with ``overrides`` (as an experiment's), validated, no arms:
    what a search's candidates are checked against. ``ConfigError`` names the field."""
    tree = _base_tree(settings, ExperimentSpec(name="job", arms=(), steps=1,
                                                overrides=dict(overrides)))
    tree["interleave"] = {**tree["interleave"], "arms": []}
    cfg: TrainConfig = validate(tree, TrainConfig)
    return cfg


def experiment_config(settings: Settings, spec: ExperimentSpec) -> TrainConfig:
    """The job that runs ``spec``: this node's config, the spec's overrides, its arms.
    ``ConfigError`` names every bad field (``overrides.model.n_layers``, ``interleave...``,
    ``steps`` when the budget holds fewer than two rounds: :func:`min_steps`)."""
    tree = _base_tree(settings, spec)
    tree["interleave"] = {"arms": [dict(a) for a in spec.arms],
                          "block_steps": spec.block_steps,
                          "warmup_steps": spec.warmup_steps,
                          "loss_margin": spec.loss_margin,
                          "min_effect": spec.min_effect,
                          # None (auto) is resolved at submission (experiments/bands.py);
                          # a check before that validates the rest
                          **({"equivalence": spec.equivalence}
                             if spec.equivalence is not None else {})}
    cfg: TrainConfig = validate(tree, TrainConfig)
    if spec.steps < (least := min_steps(len(cfg.interleave.arms), cfg.interleave.block_steps)):
        raise ConfigError.at(("steps",), f"must be at least {least} (got {spec.steps}): the "
                             f"verdict pairs each arm with the baseline once per round of "
                             f"{len(cfg.interleave.arms)} blocks of {cfg.interleave.block_steps} "
                             f"steps and needs two pairs")
    ranks, parallel = cfg.job.nproc_per_node * cfg.job.nnodes, cfg.parallel
    bad: list[FieldError] = [
        (("interleave", "arms", i, "compression", "method"), why)
        for i, a in enumerate(cfg.interleave.arms)
        if (why := compression_unavailable(cfg.arm_compression(a).method,
                                           strategy=parallel.strategy, ranks=ranks,
                                           single_rank_group=parallel.single_rank_group,
                                           tp=parallel.tp, pp=parallel.pp))]
    if bad:  # before a launch: the worker would only find out after start-up
        raise ConfigError(bad)
    return cfg


def starting_checkpoint(settings: Settings, spec: ExperimentSpec, *,
                        run_known: bool) -> Path | None:
    """The file a forked experiment starts from, named by ids (``checkpoint_run``,
    ``checkpoint_step``), never by a path: loading a checkpoint unpickles it, so only the
    daemon's own run folders (``<var_dir>/runs/<run id>/step_<8 digits>.pt``) qualify.
    ``run_known``: whether the database has that run. None when no checkpoint is named (a
    base job makes one). ``ConfigError`` names the field."""
    run, step = spec.checkpoint_run, spec.checkpoint_step
    if run is None and step is None:
        return None
    if run is None or step is None:
        missing = "checkpoint_run" if run is None else "checkpoint_step"
        raise ConfigError.at((missing,), "give checkpoint_run and checkpoint_step together")
    if run < 1 or not run_known:
        raise ConfigError.at(("checkpoint_run",), f"no run {run} on this node")
    if not 0 <= step <= 99_999_999:
        raise ConfigError.at(("checkpoint_step",), f"must be 0 .. 99999999 (got {step})")
    runs = (settings.daemon.var_dir / "runs").resolve()
    path = checkpoint_path(runs / str(run), step)
    # A run folder holds only what the trainer wrote; a link out of it is refused all the same.
    if not path.is_file() or not path.resolve().is_relative_to(runs):
        raise ConfigError.at(("checkpoint_step",), f"run {run} has no checkpoint of step {step}")
    return path


def forked_configs(settings: Settings, spec: ExperimentSpec, *,
                   run_known: bool = False) -> tuple[TrainConfig, list[TrainConfig]]:
    """The base job of a forked experiment and each arm's job (base + the arm's compression
    and precision), every one validated. ``ConfigError`` names the field: ``mode``,
    ``repeats``, ``checkpoint_run``/``checkpoint_step`` (see :func:`starting_checkpoint`),
    ``overrides.<path>``, ``job.*`` or ``arms.<i>.<field>``."""
    if spec.mode not in MODES:
        raise ConfigError.at(("mode",), f"must be one of {', '.join(MODES)} (got {spec.mode!r})")
    if spec.repeats < 1:
        raise ConfigError.at(("repeats",), f"must be at least 1 (got {spec.repeats})")
    starting_checkpoint(settings, spec, run_known=run_known)
    if len(spec.arms) < 2:
        raise ConfigError.at(("arms",), "give two or more (the first is the baseline)")
    tree = _base_tree(settings, spec)
    # Each arm is a job of its own: a node config's interleaved arms have no place in it.
    tree["interleave"] = {**tree["interleave"], "arms": []}
    base: TrainConfig = validate(tree, TrainConfig)
    return base, [arm_config(base, arm, index=i) for i, arm in enumerate(spec.arms)]


def arm_config(base: TrainConfig, arm: Mapping[str, Any], *, index: int) -> TrainConfig:
    """``base`` as arm ``index`` runs it; errors name ``arms.<index>.<field>``."""
    where = ("arms", index)
    if unknown := sorted(set(arm) - _ARM_KEYS):
        raise ConfigError([((*where, key), "unknown key") for key in unknown])
    precision = arm.get("precision")
    if precision is not None and precision not in FORKED_PRECISIONS:
        raise ConfigError.at((*where, "precision"), f"must be one of "
                             f"{', '.join(FORKED_PRECISIONS)} or null (got {precision!r})")
    compression = arm.get("compression") or {}
    if not isinstance(compression, Mapping):
        raise ConfigError.at((*where, "compression"), "must be a table of compression.* fields")
    tree = base.model_dump(mode="json")
    tree["compression"] = {**tree["compression"], **compression}
    if precision is not None:
        tree["precision"] = {**tree["precision"], "mode": precision}
    if arm.get("bucket_mb") is not None:
        tree["parallel"] = {**tree["parallel"], "bucket_mb": arm["bucket_mb"]}
    mesh = arm.get("mesh") or {}
    if not isinstance(mesh, Mapping):
        raise ConfigError.at((*where, "mesh"), "must be a table of parallel.dp/tp/pp fields")
    if unknown := sorted(set(mesh) - MESH_ARM_FIELDS):
        raise ConfigError([((*where, "mesh", key), f"not one of "
                            f"{', '.join(sorted(MESH_ARM_FIELDS))}") for key in unknown])
    for key, value in mesh.items():  # validated with the rest below (mesh_problems too)
        head, name = key.split(".", 1)
        tree[head] = {**tree[head], name: value}
    try:
        cfg = TrainConfig.model_validate(tree)
    except ValidationError as exc:  # pydantic's own messages, one bare line each
        raise ConfigError.from_validation(exc, where, bare=True) from None
    # The trainer would refuse it too, but only after a launch: say so before anything runs.
    if why := compression_unavailable(cfg.compression.method, strategy=cfg.parallel.strategy,
                                      ranks=cfg.job.nproc_per_node * cfg.job.nnodes,
                                      single_rank_group=cfg.parallel.single_rank_group,
                                      tp=cfg.parallel.tp, pp=cfg.parallel.pp):
        raise ConfigError.at((*where, "compression", "method"), why)
    return cfg


def info(view: ExperimentView) -> ExperimentInfo:
    auto = view.budget.get("equivalence_auto")
    band = view.budget.get("equivalence") if view.mode != "interleaved" else \
        (view.base_config.get("interleave") or {}).get("equivalence")
    return ExperimentInfo(
        id=view.id, name=view.name, state=view.state, mode=view.mode,
        arms=tuple(a["name"] for a in view.arms), run_id=view.run_id, verdict=view.verdict,
        config_hash=view.config_hash, versions=view.versions, created_at=view.created_at,
        finished_at=view.finished_at,
        equivalence=float(band) if isinstance(band, int | float) else None,
        equivalence_rule=str(auto["rule"]) if isinstance(auto, dict) and "rule" in auto
        else None, trial_runs=view.trial_runs,
        reused_trials=int(view.budget.get("reused_trials") or 0),
        carried_from=carried_from(view.budget),
        carried_pairs=max(map(len, carried_of(view.budget).values()), default=0))
