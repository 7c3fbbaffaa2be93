"""Admission control: a job is checked against this node before it launches, so a job that
cannot run here is refused (a 422 naming the field and why) instead of failing a minute later
or taking the node down (217 workers forked from one ``nproc_per_node=512`` did once).

``refusals`` is a pure function of the job's config and what the node has, tested with a
table; ``resources`` reads the node (psutil, and NVML for the GPUs: the daemon never
initialises CUDA, see ``daemon/devices.py``).

The same rule sizes the shipped job, what ``traind serve`` (``make serve``) trains when it is
given no config file: ``SHIPPED_RANKS`` ranks where this node admits them, so that a newcomer's
first start shows every page (the Communication page and the per-rank series need two ranks).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from traind.daemon.config import ConfigError, validate
from traind.daemon.devices import read_devices
from traind.errors import line
from traind.trainer.footprint import footprint
from traind.trainer.threads import usable_cpus

if TYPE_CHECKING:
    from pathlib import Path

    from traind.daemon.config import Settings
    from traind.errors import FieldError
    from traind.trainer.config import JobConfig, ModelConfig, TrainConfig

log = logging.getLogger("traind")
# a child process imports torch and the user's module, then builds on the meta device
FACTORY_SECONDS = 120
MEMORY_MARGIN = 0.8  # of the memory available now: the daemon, the OS and caches need the rest
GIB = 2**30
# Ranks of the shipped job (serve with no config file): two gloo ranks on a laptop make DDP's
# all-reduce, the comm and probe families and every per-rank series real; more would only
# share the same cores.
SHIPPED_RANKS = 2


@dataclass(frozen=True, slots=True)
class Resources:
    cpus: int  # usable by this process: affinity capped by the cgroup quota (trainer/threads.py)
    memory_bytes: int  # host memory available now
    gpus: int
    gpu_memory_bytes: int | None = None  # per GPU, where known


def resources() -> Resources:
    import psutil

    gpus = read_devices().count
    # The count the ranks size their threads by (affinity and cgroup quota): a job the
    # node admits is one whose default threads fit.
    return Resources(cpus=usable_cpus(), memory_bytes=int(psutil.virtual_memory().available),
                     gpus=gpus)


def on_gpu(job: JobConfig, node: Resources) -> bool:
    """Whether ``job``'s ranks run on this node's GPUs (``auto`` takes them where present)."""
    return job.device == "cuda" or (job.device == "auto" and node.gpus > 0)


def shipped_ranks(job: JobConfig, node: Resources) -> int:
    """The shipped job's ranks on ``node``: ``SHIPPED_RANKS``, fewer where admission would
    refuse them (one rank per GPU on a GPU node, per usable CPU on a CPU node), at least 1."""
    room = node.gpus if on_gpu(job, node) else node.cpus
    return max(1, min(SHIPPED_RANKS, room))


def shipped_job(settings: Settings, config: Path | None,
                node: Resources | None = None) -> Settings:
    """What ``traind serve`` starts: ``settings`` as loaded, or, when serve was given no
    ``config`` file and neither the environment nor ``--set`` names ``job.nproc_per_node``,
    the same with ``shipped_ranks`` ranks (``node``: this one, read when not given). A config
    file's job keeps ``JobConfig``'s default of one rank, as ``traind run`` does."""
    if config is not None or "nproc_per_node" in settings.job.model_fields_set:
        return settings
    ranks = shipped_ranks(settings.job, resources() if node is None else node)
    if ranks == settings.job.nproc_per_node:
        return settings
    log.info("the shipped job (no config file): %d ranks; job.nproc_per_node sets them", ranks)
    job = settings.job.model_copy(update={"nproc_per_node": ranks})
    # validated again: the rest of the tree may depend on the ranks (the mesh, compression)
    shipped: Settings = validate({**dict(settings), "job": job}, type(settings))
    return shipped


def factory_params(model: ModelConfig, *, tp: int = 1) -> int:
    """A factory model's parameter count, built on the meta device in a child process (the
    daemon imports neither torch nor the user's code: trainer/factory.main); ``ConfigError``
    at ``model.factory`` when it cannot be built, or with ``tp > 1`` carries no usable plan,
    before anything is recorded or launched."""
    asked = json.dumps({"model": model.model_dump(mode="json"), "tp": tp})
    try:
        proc = subprocess.run([sys.executable, "-m", "traind.trainer.factory"],
                              input=asked, capture_output=True, text=True,
                              timeout=FACTORY_SECONDS, check=False)
        out = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        out = {"errors": [[list(model.user_field or ("model", "factory")),
                           f"measuring the model failed: {exc}"]]}
    if "params" in out:
        return int(out["params"])
    found = [(tuple(loc), msg) for loc, msg in out.get("errors", [])] or [
        (model.user_field or ("model", "factory"),
         f"measuring the model failed: {proc.stderr.strip()[-500:]}")]
    raise ConfigError(found, "\n".join(line(*e) for e in found))


def check(cfg: TrainConfig, node: Resources, *, oversubscribe: bool = False) -> None:
    """``ConfigError`` naming each field that keeps ``cfg`` from running on ``node``."""
    if found := refusals(cfg, node, oversubscribe=oversubscribe, params=_measured(cfg)):
        raise ConfigError(found, "this node cannot run the job:\n" + "\n".join(
            f"  {line(*e)}" for e in found))


def problems(cfg: TrainConfig, node: Resources, *, oversubscribe: bool = False) -> list[str]:
    """Why ``cfg`` cannot run on ``node``: ``"field: reason"`` lines, empty when it can."""
    return [line(*e) for e in refusals(cfg, node, oversubscribe=oversubscribe,
                                       params=_measured(cfg))]


def _measured(cfg: TrainConfig) -> int | None:
    """A factory model's parameter count (a child process; None for traind's own model,
    which ``trainer/footprint.param_count`` counts from its config)."""
    return (factory_params(cfg.model, tp=cfg.parallel.tp) if cfg.model.user_field is not None
            else None)


def refusals(cfg: TrainConfig, node: Resources, *, oversubscribe: bool = False,
             params: int | None = None) -> list[FieldError]:
    """Why ``cfg`` cannot run on ``node``: ``(loc, reason)`` pairs, empty when it can.
    ``params``: a factory model's measured count (``factory_params``)."""
    out: list[FieldError] = []
    job = cfg.job
    gpu = on_gpu(job, node)
    if job.device == "cuda" and node.gpus == 0:
        out.append((("job", "device"),
                    "cuda, but this node has no CUDA device (use auto or cpu)"))
    ranks = job.nproc_per_node
    if not oversubscribe:
        if gpu and node.gpus and ranks > node.gpus:
            out.append((("job", "nproc_per_node"), f"{ranks} ranks, but this node has "
                        f"{node.gpus} GPUs (one rank per GPU; daemon.oversubscribe allows "
                        "more)"))
        if not gpu and ranks > node.cpus:
            out.append((("job", "nproc_per_node"), f"{ranks} ranks, but this node has "
                        f"{node.cpus} CPUs (daemon.oversubscribe allows more)"))
        if job.threads > node.cpus:
            out.append((("job", "threads"), f"{job.threads} threads per rank, but this node "
                        f"has {node.cpus} CPUs"))
    fp = footprint(cfg, params=params)
    # On the CPU every rank's memory is host memory; on a GPU a rank's is its GPU's.
    need = fp.bytes_per_rank * (1 if gpu else ranks)
    have = node.gpu_memory_bytes if gpu else node.memory_bytes
    if have is not None and need > MEMORY_MARGIN * have:
        where = "per GPU" if gpu else f"for {ranks} rank{'s' * (ranks > 1)}"
        # a factory model's activations depend on shapes traind cannot read: not estimated
        acts = ("its activations not estimated" if cfg.model.user_field is not None else
                f"{fp.activations_bytes / GIB:.1f} GiB of activations at job.batch_size="
                f"{job.batch_size}, model.seq_len={cfg.model.seq_len}")
        out.append((cfg.model.user_field or ("model",), (
            f"this job needs about {need / GIB:.1f} GiB {where} ({fp.params:,} "
            f"parameters: {fp.weights_bytes / GIB:.1f} GiB of weights, gradients and "
            f"optimizer state a rank, {acts}), but {have / GIB:.1f} GiB is available (with "
            f"a {1 - MEMORY_MARGIN:.0%} margin); make model.* or job.batch_size smaller")))
    return out
