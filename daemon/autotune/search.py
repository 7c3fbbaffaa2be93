"""The auto-tuner's decisions: pure functions over plain data (no database, no torch, no jobs).

A search space is precision x compression (method and parameters) x DDP bucket size. The
tuner searches it in **stages**, one dimension at a time, and each stage by **successive
halving**: every round is one A/B experiment of the surviving challengers against the current
best, and only the better half goes on, with twice the budget.

Why stages rather than the full product at once: the baseline must never be a straw man. A
compression method is judged against the uncompressed all-reduce *at the same precision*, with
bucketing and overlap on; so the precision is chosen first (compression ``none``), then
compression at that precision, then the bucket size with both fixed. A candidate that changed
precision and compression at once could not say which of the two bought the speed.

Per round, from each challenger's verdict (``daemon/experiments/stats.py``):

- ``better``: it beat the best. The largest ratio among them becomes the new best (and the old
  best leaves the stage: it was beaten with a test that controls false positives).
- ``worse``, ``no difference`` (within +-1%: not worth a change), ``rejected (quality)``,
  ``failed (error)``: out.
- ``inconclusive (budget spent)``: survives, ranked by its ratio.

The next round takes the best ``ceil(n/2)`` survivors of an ``n``-challenger round and doubles
the steps; a stage ends when nobody survives or after ``max_rounds``. Bucket sizes cannot change
inside a running DDP job (its buckets are built once), so that stage runs in forked mode.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from traind.errors import FieldErrors
from traind.trainer.config import PRECISION_MODES, SWITCHABLE_PRECISIONS, compression_unavailable

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

STAGES = ("precision", "compression", "bucket")
# Interleaved arms switch precision at block boundaries: only stateless autocast modes can
# (SWITCHABLE_PRECISIONS). The tuner knows every fixed mode; adaptive is none.
KNOWN_PRECISIONS = tuple(m for m in PRECISION_MODES if m != "adaptive")
# what the others carry that an arm switch cannot swap at a block boundary
_UNSWITCHABLE = {"fp16": "it keeps a loss scaler",
                 "fp8": "it swaps the Linear layers for torchao's Float8Linear"}
_OUT = frozenset({"worse", "no difference", "no gain", "rejected (quality)", "failed (error)"})
# setting_label of no setting: the en dash the pages show for a value that does not exist.
# web.views.DASH cannot be imported here (the daemon does not import the web layer);
# tests/web/test_autotune_views.py checks the two agree.
NO_SETTING = "\u2013"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting: a precision, a compression table (``method`` and its parameters) and a
    bucket size in MiB (None: the job's own)."""

    precision: str
    compression: Mapping[str, Any]
    bucket_mb: float | None = None

    @property
    def name(self) -> str:
        """An arm name (``[A-Za-z0-9_.-]``, at most 32): ``bf16.int8``,
        ``fp32.powersgd-rank4``, ``bf16.none.b100`` (bucket 100 MiB)."""
        params = "-".join(f"{k.removeprefix(self.method + '_')}{v}"
                          for k, v in sorted(self.compression.items()) if k != "method")
        name = f"{self.precision}.{self.method}" + (f"-{params}" if params else "")
        if self.bucket_mb is not None:
            name += f".b{self.bucket_mb:g}"
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        if len(name) > 32:  # still unique: the full name's digest
            name = name[:25] + "-" + hashlib.sha1(name.encode()).hexdigest()[:6]
        return name

    @property
    def method(self) -> str:
        return str(self.compression.get("method", "none"))

    def arm(self) -> dict[str, Any]:
        """The arm an experiment takes (see ``daemon/experiments.arm_config``)."""
        arm: dict[str, Any] = {"name": self.name, "precision": self.precision,
                               "compression": dict(self.compression)}
        if self.bucket_mb is not None:
            arm["bucket_mb"] = self.bucket_mb
        return arm

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "precision": self.precision,
                "compression": dict(self.compression), "bucket_mb": self.bucket_mb}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        return cls(d["precision"], dict(d["compression"]), d.get("bucket_mb"))


def setting_label(setting: Mapping[str, Any] | None) -> str:
    """``bf16 · powersgd (rank 4) · bucket 100 MiB``: a setting (``Candidate.as_dict``, as the
    API returns it) as people read it; the parts a setting leaves out (a promotion that keeps the
    precision) are not shown. It lives beside the setting's definition because the web pages and
    the CLI both show it, and the CLI does not import the web layer."""
    if not setting:
        return NO_SETTING
    parts = []
    if setting.get("precision"):
        parts.append(str(setting["precision"]))
    compression = setting.get("compression") or {}
    if compression:
        method = str(compression.get("method", "none"))
        params = ", ".join(f"{k.removeprefix(method + '_')} {v}"
                           for k, v in sorted(compression.items()) if k != "method")
        parts.append(f"{method} ({params})" if params else method)
    if setting.get("bucket_mb") is not None:
        parts.append(f"bucket {setting['bucket_mb']:g} MiB")
    return " \u00b7 ".join(parts) or NO_SETTING


@dataclass(frozen=True, slots=True)
class Space:
    """What to search. ``compressions``: tables such as ``{"method": "powersgd",
    "powersgd_rank": 4}``; ``{"method": "none"}`` is always included (it is the baseline)."""

    precisions: tuple[str, ...] = ("fp32", "bf16")
    compressions: tuple[Mapping[str, Any], ...] = ({"method": "none"}, {"method": "int8"})
    bucket_mb: tuple[float, ...] = ()  # empty: keep the job's bucket size (no bucket stage)


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the node can run, as feasibility needs it."""

    device: str  # "cpu" | "cuda"
    ranks: int  # nproc_per_node x nnodes of the job
    strategy: str  # parallel.strategy
    fp8: bool = False  # fp8 can run: torchao, and a GPU with fp8 tensor cores (compute
    # capability >= 8.9) or no GPU (torchao's emulation)
    bf16: bool = True


def infeasible(c: Candidate, hw: Hardware) -> str | None:
    """Why ``c`` cannot run on ``hw`` (None when it can): shown beside the candidate."""
    if c.precision not in KNOWN_PRECISIONS:
        return f"precision {c.precision!r} is not one of {', '.join(KNOWN_PRECISIONS)}"
    if c.precision == "fp8" and not hw.fp8:
        return ("fp8 needs torchao and, on a GPU, fp8 tensor cores (compute capability 8.9+); "
                f"this node runs on {hw.device}")
    if c.precision not in SWITCHABLE_PRECISIONS:
        return (f"{c.precision} cannot switch inside a running job "
                f"({_UNSWITCHABLE.get(c.precision, 'it keeps state')}); the tuner compares "
                "precisions in one job")
    if c.precision == "bf16" and not hw.bf16:
        return "bf16 is not supported by this device"
    if why := compression_unavailable(c.method, strategy=hw.strategy, ranks=hw.ranks):
        return f"compression {why}"
    if c.bucket_mb is not None and c.bucket_mb <= 0:
        return f"bucket_mb must be positive (got {c.bucket_mb})"
    return None


def candidates(space: Space, hw: Hardware) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Every candidate of the space, split into those that can run and those left out with
    the reason. Bucket sizes pair with compression ``none`` at the first precision only: the
    bucket stage varies them after the other two stages chose."""
    methods = [dict(c) for c in space.compressions]
    if not any(m.get("method", "none") == "none" for m in methods):
        methods.insert(0, {"method": "none"})
    every = [Candidate(p, m) for p in space.precisions for m in methods]
    every += [Candidate(space.precisions[0], {"method": "none"}, b) for b in space.bucket_mb]
    ok, out = [], []
    for c in every:
        reason = infeasible(c, hw)
        if reason is None:
            ok.append(c)
        else:
            out.append((c, reason))
    return ok, out


@dataclass(frozen=True, slots=True)
class Round:
    stage: str
    index: int  # 0-based within its stage
    baseline: Candidate
    challengers: tuple[Candidate, ...]
    steps: int
    experiment_id: int | None = None
    verdicts: Mapping[str, Mapping[str, Any]] | None = None  # challenger name -> verdict

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "index": self.index, "baseline": self.baseline.as_dict(),
                "challengers": [c.as_dict() for c in self.challengers], "steps": self.steps,
                "experiment_id": self.experiment_id,
                "verdicts": dict(self.verdicts) if self.verdicts is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Round:
        return cls(d["stage"], d["index"], Candidate.from_dict(d["baseline"]),
                   tuple(Candidate.from_dict(c) for c in d["challengers"]), d["steps"],
                   d.get("experiment_id"), d.get("verdicts"))


@dataclass(frozen=True, slots=True)
class Plan:
    """The tuner's whole state between rounds: serialisable, so a restarted daemon goes on."""

    best: Candidate
    feasible: tuple[Candidate, ...]
    steps: int  # the first round's budget in steps; each later round of a stage doubles it
    max_rounds: int = 3
    stage: int = 0  # index into STAGES
    survivors: tuple[Candidate, ...] | None = None  # None: the stage has not started
    rounds: tuple[Round, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        return {"best": self.best.as_dict(), "feasible": [c.as_dict() for c in self.feasible],
                "steps": self.steps, "max_rounds": self.max_rounds, "stage": self.stage,
                "survivors": None if self.survivors is None
                else [c.as_dict() for c in self.survivors],
                "rounds": [r.as_dict() for r in self.rounds]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        surv = d.get("survivors")
        return cls(Candidate.from_dict(d["best"]),
                   tuple(Candidate.from_dict(c) for c in d["feasible"]), d["steps"],
                   d.get("max_rounds", 3), d.get("stage", 0),
                   None if surv is None else tuple(Candidate.from_dict(c) for c in surv),
                   tuple(Round.from_dict(r) for r in d.get("rounds", ())))


def start(feasible: Sequence[Candidate], *, base: Candidate, steps: int,
          max_rounds: int = 3) -> Plan:
    """The plan before any round: ``base`` (the job's own setting, compression none) is the
    first best."""
    if steps < 1:
        raise FieldErrors.at(("steps",), f"must be at least 1 (got {steps})")
    if max_rounds < 1:
        raise FieldErrors.at(("max_rounds",), f"must be at least 1 (got {max_rounds})")
    return Plan(best=base, feasible=tuple(feasible), steps=steps, max_rounds=max_rounds)


def _stage_field(stage: str, c: Candidate, best: Candidate) -> bool:
    """Whether ``c`` differs from ``best`` in this stage's dimension only."""
    if stage == "precision":
        return (c.precision != best.precision and c.method == "none"
                and c.bucket_mb == best.bucket_mb)
    if stage == "compression":
        return c.method != "none" and c.bucket_mb is None
    return c.bucket_mb is not None and c.bucket_mb != best.bucket_mb


def _in_stage(stage: str, c: Candidate, best: Candidate) -> Candidate | None:
    """``c`` as this stage tries it: the stage's dimension from ``c``, the rest from ``best``
    (compression at the chosen precision; bucket sizes with both chosen)."""
    if not _stage_field(stage, c, best):
        return None
    if stage == "precision":
        return replace(best, precision=c.precision)
    if stage == "compression":
        return Candidate(best.precision, dict(c.compression), best.bucket_mb) \
            if c.precision == best.precision else None
    return replace(best, bucket_mb=c.bucket_mb)


def next_round(plan: Plan) -> tuple[Plan, Round | None]:
    """The next experiment to run, or None when the search is over (``plan.best`` wins)."""
    while plan.stage < len(STAGES):
        stage = STAGES[plan.stage]
        if plan.survivors is None:  # the stage starts: its candidates against the best
            seen: dict[str, Candidate] = {}
            for c in plan.feasible:
                tried = _in_stage(stage, c, plan.best)
                if tried is not None and tried.name != plan.best.name:
                    seen.setdefault(tried.name, tried)
            plan = replace(plan, survivors=tuple(seen.values()))
        done = [r for r in plan.rounds if r.stage == stage]
        if plan.survivors and len(done) < plan.max_rounds:
            rnd = Round(stage, len(done), plan.best, tuple(plan.survivors),
                        plan.steps * 2 ** len(done))
            return plan, rnd
        plan = replace(plan, stage=plan.stage + 1, survivors=None)
    return plan, None


def record(plan: Plan, rnd: Round, verdicts: Mapping[str, Mapping[str, Any]]) -> Plan:
    """``plan`` after round ``rnd`` ended with ``verdicts`` (challenger name -> the verdict
    record: ``kind`` and ``ratio`` at least). A challenger without a verdict counts as failed."""
    rnd = replace(rnd, verdicts={k: dict(v) for k, v in verdicts.items()})
    best, ranked = plan.best, []
    winners = []
    for c in rnd.challengers:
        v = verdicts.get(c.name) or {"kind": "failed (error)"}
        ratio = _ratio(v)
        if v.get("kind") == "better":
            winners.append((ratio, c))
        elif v.get("kind") not in _OUT:  # inconclusive: it may yet be better
            ranked.append((ratio, c))
    if winners:
        winners.sort(key=lambda rc: -rc[0])
        best = winners[0][1]
        ranked += winners[1:]  # beat the old best too: worth a round against the new one
    ranked.sort(key=lambda rc: -rc[0])
    keep = math.ceil(len(rnd.challengers) / 2)
    survivors = tuple(c for _, c in ranked[:keep])
    return replace(plan, best=best, survivors=survivors, rounds=(*plan.rounds, rnd))


def _ratio(v: Mapping[str, Any]) -> float:
    r = v.get("ratio")
    return float(r) if isinstance(r, int | float) and math.isfinite(r) else 0.0
