"""What a measurement rests on: the hash of a configuration and the versions it ran with.

One home for the hash: an experiment's ``config_hash`` (``daemon/db/queue.py``) and a
promotion's are both :func:`config_hash` of a JSON value. A promotion compares its evidence
with its target job on the *basis* of a configuration (:data:`BASIS`): the fields that make
a throughput or a loss figure mean something else when they change (the model, the batch,
the ranks, the device, the parallel layout). The fields a tuner tunes (precision,
compression, bucket size) and those that do not touch a step (steps, eval cadence, names)
are left out, so the evidence of an experiment run from the daemon's settings applies to a
long job of the same model, and to no other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traind.errors import dotted

if TYPE_CHECKING:
    from collections.abc import Sequence

    from traind.errors import FieldError, Loc

# The TrainConfig fields (paths into its JSON) a piece of evidence must share with its target.
BASIS: tuple[Loc, ...] = (
    ("model",), ("job", "batch_size"), ("job", "nproc_per_node"), ("job", "nnodes"),
    ("job", "device"), ("parallel", "strategy"), ("parallel", "grad_accum"))
# Versions that must agree too: a figure measured on another device says nothing of this one.
# traind and torch versions are recorded, not compared: the job runs the daemon's own
# installation, and a daemon upgraded between a search and its promotion is worth seeing,
# not worth refusing.
SAME_VERSIONS = ("device",)


def config_hash(definition: Any) -> str:
    """sha256 of ``definition`` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(definition, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def basis(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`BASIS` fields of a stored TrainConfig, by dotted path (None: absent)."""
    out: dict[str, Any] = {}
    for loc in BASIS:
        value: Any = config
        for part in loc:
            value = value.get(part) if isinstance(value, Mapping) else None
        out[dotted(loc)] = value
    return out


@dataclass(frozen=True, slots=True)
class TorchBuild:
    version: str  # torch.__version__, e.g. "2.13.0+cpu"
    cuda: str | None  # torch.version.cuda: None for a CPU build


@functools.cache
def torch_build() -> TorchBuild:
    """The installed torch's version and CUDA build, read from its ``torch/version.py``
    without importing torch: the daemon records them and never computes with torch, and
    ``import torch`` is over a second of every daemon start (and of every CLI command). That
    file is plain assignments, which torch's own ``torch.version`` module is."""
    spec = importlib.util.find_spec("torch")  # a top-level name: finds, imports nothing
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).with_name("version.py")
        with contextlib.suppress(OSError, SyntaxError):
            namespace: dict[str, Any] = {}
            exec(compile(path.read_text(), str(path), "exec"), namespace)
            if isinstance(version := namespace.get("__version__"), str):
                return TorchBuild(version, namespace.get("cuda"))
    import torch  # a layout without the file: ask torch itself

    return TorchBuild(torch.__version__, torch.version.cuda)


def node_versions(device: str) -> dict[str, str]:
    """The versions a job started by this daemon runs with (``device``: ``read_devices().kind``,
    as experiments record it)."""
    from traind import __version__
    return {"traind": __version__, "torch": torch_build().version, "device": device}


@dataclass(frozen=True, slots=True)
class Provenance:
    """A configuration's basis and hash, the versions it ran with, and whose it is."""

    source: str  # "run 5", "experiment 12": for the error text
    basis: dict[str, Any]
    versions: dict[str, str]
    config_hash: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config_hash", config_hash(self.basis))

    @classmethod
    def of(cls, source: str, config: Mapping[str, Any], versions: Mapping[str, str]
           ) -> Provenance:
        return cls(source, basis(config), dict(versions))


def mismatches(evidence: Sequence[Provenance], target: Provenance) -> list[FieldError]:
    """Each basis field or compared version in which a piece of evidence differs from the
    target, with both values and whose they are (empty: the evidence applies). A table
    (``model``) is compared field by field, so the error names ``model.d_model``."""
    problems: list[FieldError] = []
    for ev in evidence:
        for loc in BASIS:
            key = dotted(loc)
            for sub, mine, theirs in _differ(loc, ev.basis.get(key), target.basis.get(key)):
                problems.append((sub, f"{mine!r} in {ev.source}, {theirs!r} in "
                                      f"{target.source}"))
        for name in SAME_VERSIONS:
            if ev.versions.get(name) != target.versions.get(name):
                problems.append((("versions", name), f"{ev.versions.get(name)!r} in "
                                 f"{ev.source}, {target.versions.get(name)!r} in "
                                 f"{target.source}"))
    return problems


def _differ(loc: Loc, a: Any, b: Any) -> list[tuple[Loc, Any, Any]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in _differ((*loc, k), a.get(k), b.get(k))]
    return [] if a == b else [(loc, a, b)]


def merged_versions(evidence: Sequence[Provenance]) -> dict[str, str]:
    """The versions of several pieces of evidence as one record: a value each, or the
    distinct values joined where they differ (a daemon upgraded between two rounds)."""
    names = sorted({k for ev in evidence for k in ev.versions})
    return {k: ", ".join(sorted({ev.versions[k] for ev in evidence if k in ev.versions}))
            for k in names}

