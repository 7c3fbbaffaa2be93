"""The auto-tuner's decisions: pure functions over plain data (no database, no torch, no jobs).

A search space is precision x compression (method and parameters) x DDP bucket size, and
optionally the mesh shape (dp x tp x pp of the job's world size). The
tuner searches it in **stages**, one dimension at a time, and each stage by **successive
halving**: every round is one A/B experiment of the surviving challengers against the current
best, and only the better half goes on, with twice the budget.

The **mesh** stage comes first, when the search asks for it (``Space.meshes``, the job's
other shapes of its world size: ``daemon/autotune/mesh.py``). The mesh decides what the rest
can be: gradient compression needs DDP over the whole world (tp = pp = 1,
``compression_unavailable``), a bucket size is DDP's, and the rules refuse some precisions
with tp or pp (``mesh_problems``). A later stage's verdict holds for the mesh it was measured
on only, so measuring it before the mesh is chosen would be wasted (and a mesh chosen last
would be judged against a dp setting tuned for dp alone). So the mesh is chosen first, at the
job's own precision with compression none (the setting every later stage starts from too:
the mesh arms differ in the mesh only), and the stages after it search on the winner's mesh;
their candidates that mesh refuses (compression on tp > 1) are left out by the one rule
(``infeasible``), and a compression the job's own mesh refused is tried on a winner that
runs it (``candidates``). What this order cannot find: dp + int8 beating a tp winner that was
faster than dp without compression; the joint stage does not revisit the mesh. A mesh cannot
change inside a running job: its rounds are forked, each arm a short job of its own from one
checkpoint, judged as the bucket stage's are (speed, and the quality a forked ``better``
requires), and a mesh winner is promoted into no running job (``needs_restart``).

Why stages rather than the full product at once: the baseline must never be a straw man. A
compression method is judged against the uncompressed all-reduce *at the same precision*, with
bucketing and overlap on; so the precision is chosen first (compression ``none``), then
compression at that precision, then the bucket size with both fixed. A candidate that changed
precision and compression at once could not say which of the two bought the speed.

But the two interact: int8 halves an fp32 gradient's bytes and gains little on a bf16 one,
which is half the bytes already, so fp32 + int8 can beat bf16 with anything although bf16 beat
fp32 alone. The **joint** stage, after compression, tries what the two stages never did: every
other precision with every compression method that did not show harm, against the best. Once
the single-dimension choices are made (and attributed), it can only replace them with a
combination that is faster still; where there is no interaction its challengers are slower and
``worse`` (or the pruning below) ends them in their first round, and a faster challenger faces
its quality round as anywhere.

**Speed by interleaving, quality by forking.** A speed round interleaves the arms in one job:
the most precise speed measurement there is, but both arms train one shared model, so it cannot
show that an arm leaves the model's quality alone (its guard can only raise an alarm on harm).
So an arm that wins a speed round faces a **quality round** next: forked trials, every arm on its
own copy of the weights from one checkpoint, same data, validation loss on a fixed held-out set
(``daemon/experiments/forked.py``). Bucket sizes cannot change inside a running DDP job (its
buckets are built once): that stage's speed rounds are forked already, and a forked ``better``
already required the quality, so it needs no quality round.

Per speed round, from each challenger's verdict (``daemon/experiments/stats.py``):

- ``better``: it beat the best on speed. In a forked stage the largest ratio among them becomes
  the new best (and the old best leaves the stage: it was beaten with a test that controls false
  positives); in an interleaved stage they all go to a quality round first.
- ``worse``, ``no difference`` (within the equivalence band), ``no gain`` (cannot be the
  smallest effect worth having faster), ``rejected (quality)``, ``failed (error)``: out.
- ``inconclusive (budget spent)``, ``not shown (budget spent)``: survive, ranked by ratio,
  unless the round measured them no faster than the best (a ratio of 1 or below): an arm not
  even estimated faster is not worth a round of twice the steps (``PRUNE_AT``).

Per quality round, from each challenger's quality status (non-inferior, harm, not shown):
the fastest (by its speed round's ratio) that is non-inferior becomes the best, and the others
that passed face it in the next speed round; harm is out; "not shown" faces a longer quality
round (twice the steps of its last) while nobody passed, else the new best in a speed round;
a fresh winner's trials are ``quality_steps`` long whatever rounds came before. A stage runs
at most ``max_rounds`` speed rounds and ``max_rounds`` quality rounds.

A search's quality rounds share one starting checkpoint, the first one's, and each takes the
trials an earlier one ran of its arms at the same length (``Round.reuse``,
``daemon/experiments/reuse.py``): a forked trial is a function of checkpoint, arm and repeat,
so the best so far, every quality round's baseline and mostly a challenger or the baseline of
an earlier one, is trained once per search and not again in each round (bench/tuner.py: with
the fresh winner's short trials, the quality rounds' steps fell 32-39%).

The next speed round takes the best ``ceil(n/2)`` survivors of an ``n``-challenger round and
doubles each arm's pairs with the best; a stage ends when nobody survives (and nobody awaits a
quality round). The pairs an earlier round of the stage measured against the same best count
(``Round.carry``, ``daemon/experiments/reuse.py``): the always-valid test may go on after an
undecided look, in a later job as in the same one, so the round's verdicts go on from them and
it runs only the difference (each arm's pairs 10, 20, 40 over three rounds, as before, in 10 +
10 + 20 pairs' steps rather than 10 + 20 + 40). A new best starts afresh: nobody measured it.
bench/tuner.py: the searches' steps fell 11-22% at the same found-best rates (2 points lower
in one scenario of four: an arm that survives a round was unlucky in it, and its pairs of
then stay in its evidence).
An interleaved round's budget is per arm: ``steps`` is a two-arm round's, and a round of ``k``
arms runs ``k/2`` times as many (``round_steps``), so every arm gets as many pairs with the best
whatever the number of challengers (a first round of 4 arms in a two-arm budget gave each 5
pairs, too few for the always-valid interval to have any bound: a round that could only rank).
A forked round's ``steps`` are per trial already.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from traind.daemon.autotune.mesh import label as mesh_label
from traind.daemon.autotune.mesh import shape_of as mesh_shape
from traind.errors import FieldErrors
from traind.trainer.config import PRECISION_MODES, SWITCHABLE_PRECISIONS, compression_unavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from traind.trainer.mesh import MeshShape

STAGES = ("mesh", "precision", "compression", "joint", "bucket")
# a running job cannot change its mesh, nor (DDP) its bucket size
FORKED_STAGES = frozenset({"mesh", "bucket"})
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
    """One setting: a precision, a compression table (``method`` and its parameters), a
    bucket size in MiB (None: the job's own) and a mesh (None: the job's own; else the dotted
    config overrides that run the job on another shape, ``daemon/autotune/mesh.py``)."""

    precision: str
    compression: Mapping[str, Any]
    bucket_mb: float | None = None
    mesh: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        """An arm name (``[A-Za-z0-9_.-]``, at most 32): ``bf16.int8``,
        ``fp32.powersgd-rank4``, ``bf16.none.b100`` (bucket 100 MiB), ``fp32.none.dp2tp2``
        (the mesh dp2 x tp2)."""
        params = "-".join(f"{k.removeprefix(self.method + '_')}{v}"
                          for k, v in sorted(self.compression.items()) if k != "method")
        name = f"{self.precision}.{self.method}" + (f"-{params}" if params else "")
        if self.bucket_mb is not None:
            name += f".b{self.bucket_mb:g}"
        if (shape := mesh_shape(self.mesh)) is not None:
            name += f".{mesh_label(shape)}"
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
        if self.mesh is not None:  # a forked arm's own; runner.round_spec moves a shared one
            arm["mesh"] = dict(self.mesh)
        return arm

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "precision": self.precision,
                "compression": dict(self.compression), "bucket_mb": self.bucket_mb,
                "mesh": None if self.mesh is None else dict(self.mesh)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        mesh = d.get("mesh")
        return cls(d["precision"], dict(d["compression"]), d.get("bucket_mb"),
                   None if mesh is None else dict(mesh))


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
    if (shape := mesh_shape(setting.get("mesh"))) is not None:
        parts.append(_mesh_text(shape, setting["mesh"]))
    return " \u00b7 ".join(parts) or NO_SETTING


def needs_restart(best: Candidate) -> str | None:
    """Why a running job cannot take ``best`` at a step boundary, and what to start one with
    (None: it can): a mesh is built once, when the job starts. The runner sends such a winner
    to no running job, and the search's best carries this line."""
    if best.mesh is None:
        return None
    sets = ", ".join(f"{k}={v}" for k, v in best.mesh.items())
    return f"a job builds its mesh when it starts: start one with {sets}"


# The overrides beside the shape, as setting_label names them (daemon/autotune/mesh.py says
# when the tuner sets each).
_MESH_EXTRAS = (("parallel.strategy", "{}"), ("job.batch_size", "batch {} per rank"),
                ("parallel.microbatches", "{} micro-batches"))


def _mesh_text(shape: MeshShape, table: Mapping[str, Any]) -> str:
    """``mesh dp 2 \u00d7 tp 2 \u00d7 pp 1 (fsdp, batch 8 per rank)``."""
    extras = ", ".join(fmt.format(table[k]) for k, fmt in _MESH_EXTRAS if k in table)
    dims = f"dp {shape.dp} \u00d7 tp {shape.tp} \u00d7 pp {shape.pp}"
    return f"mesh {dims}" + (f" ({extras})" if extras else "")


@dataclass(frozen=True, slots=True)
class Space:
    """What to search. ``compressions``: tables such as ``{"method": "powersgd",
    "powersgd_rank": 4}``; ``{"method": "none"}`` is always included (it is the baseline)."""

    precisions: tuple[str, ...] = ("fp32", "bf16")
    compressions: tuple[Mapping[str, Any], ...] = ({"method": "none"}, {"method": "int8"})
    bucket_mb: tuple[float, ...] = ()  # empty: keep the job's bucket size (no bucket stage)
    # the job's other mesh shapes, as overrides (daemon/autotune/mesh.py's ``settings``);
    # empty: keep the job's mesh (no mesh stage)
    meshes: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the node can run, as feasibility needs it."""

    device: str  # "cpu" | "cuda"
    ranks: int  # nproc_per_node x nnodes of the job
    strategy: str  # parallel.strategy
    fp8: bool = False  # fp8 can run: torchao, and a GPU with fp8 tensor cores (compute
    # capability >= 8.9) or no GPU (torchao's emulation)
    bf16: bool = True
    tp: int = 1  # the job's own mesh (a candidate with a mesh brings its own)
    pp: int = 1


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
    mesh = c.mesh or {}
    if why := compression_unavailable(
            c.method, strategy=str(mesh.get("parallel.strategy", hw.strategy)), ranks=hw.ranks,
            tp=int(mesh.get("parallel.tp", hw.tp)), pp=int(mesh.get("parallel.pp", hw.pp))):
        return f"compression {why}"
    if c.bucket_mb is not None and c.bucket_mb <= 0:
        return f"bucket_mb must be positive (got {c.bucket_mb})"
    return None


def candidates(space: Space, hw: Hardware) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Every candidate of the space, split into those that can run and those left out with
    the reason. Bucket sizes and meshes pair with compression ``none`` at the first precision
    only: their stages vary them against the best of the time (``_in_stage``).

    A candidate the job's own mesh refuses but a mesh of the space runs (int8 in a tp2 job
    that may move to dp4) is both: kept, for the stages after a winner that runs it
    (``_stage_candidates`` asks ``infeasible`` again on the best's mesh), and listed with the
    reason and that proviso."""
    methods = [dict(c) for c in space.compressions]
    if not any(m.get("method", "none") == "none" for m in methods):
        methods.insert(0, {"method": "none"})
    every = [Candidate(p, m) for p in space.precisions for m in methods]
    every += [Candidate(space.precisions[0], {"method": "none"}, b) for b in space.bucket_mb]
    every += [Candidate(space.precisions[0], {"method": "none"}, mesh=dict(m))
              for m in space.meshes]
    ok, out = [], []
    for c in every:
        reason = infeasible(c, hw)
        if reason is None:
            ok.append(c)
            continue
        if c.mesh is None and any(infeasible(replace(c, mesh=m), hw) is None
                                  for m in space.meshes):
            ok.append(c)
            reason += " (on the job's own mesh; tried if the mesh stage's winner runs it)"
        out.append((c, reason))
    return ok, out


def runs_on(c: Candidate, space: Space, hw: Hardware) -> Candidate:
    """``c`` on a mesh it runs on: its own (the job's) if that runs it, else the first of the
    space's meshes that does (the arm a check up front configures)."""
    if infeasible(c, hw) is None or c.mesh is not None:
        return c
    return next((m for m in (replace(c, mesh=t) for t in space.meshes)
                 if infeasible(m, hw) is None), c)


def runs_forked(stage: str, phase: str) -> bool:
    """Whether a round runs as forked trials (each arm on its own weights) rather than
    interleaved blocks in one job: the one rule ``round_spec`` and the pages read."""
    return phase == "quality" or stage in FORKED_STAGES


@dataclass(frozen=True, slots=True)
class Round:
    """One experiment of the search. ``phase``: ``speed`` (is the challenger faster?) or
    ``quality`` (does it leave the model's validation loss within the margin? ``speed`` then
    holds each challenger's ratio from the speed round that sent it)."""

    stage: str
    index: int  # 0-based within its stage and phase
    baseline: Candidate
    challengers: tuple[Candidate, ...]
    steps: int
    experiment_id: int | None = None
    verdicts: Mapping[str, Mapping[str, Any]] | None = None  # challenger name -> verdict
    phase: str = "speed"
    speed: Mapping[str, float] | None = None
    # a quality round's: the search's earlier quality experiments, whose starting checkpoint
    # it starts from and whose trials of its arms it takes (daemon/experiments/reuse.py)
    reuse: tuple[int, ...] = ()
    # an interleaved speed round's: the stage's earlier speed experiments against the same
    # best, whose pairs its verdicts go on from (daemon/experiments/reuse.py)
    carry: tuple[int, ...] = ()

    @property
    def forked(self) -> bool:
        return runs_forked(self.stage, self.phase)

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "index": self.index, "baseline": self.baseline.as_dict(),
                "challengers": [c.as_dict() for c in self.challengers], "steps": self.steps,
                "experiment_id": self.experiment_id,
                "verdicts": dict(self.verdicts) if self.verdicts is not None else None,
                "phase": self.phase, "speed": dict(self.speed) if self.speed else None,
                "reuse": list(self.reuse), "carry": list(self.carry)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Round:
        return cls(d["stage"], d["index"], Candidate.from_dict(d["baseline"]),
                   tuple(Candidate.from_dict(c) for c in d["challengers"]), d["steps"],
                   d.get("experiment_id"), d.get("verdicts"), d.get("phase", "speed"),
                   d.get("speed"), tuple(d.get("reuse") or ()), tuple(d.get("carry") or ()))


@dataclass(frozen=True, slots=True)
class Plan:
    """The tuner's whole state between rounds: serialisable, so a restarted daemon goes on."""

    best: Candidate
    feasible: tuple[Candidate, ...]
    steps: int  # a stage's first two-arm speed round's budget (round_steps); later rounds double it
    max_rounds: int = 3
    stage: int = 0  # index into STAGES
    survivors: tuple[Candidate, ...] | None = None  # None: the stage has not started
    rounds: tuple[Round, ...] = field(default_factory=tuple)
    # steps per forked trial of a stage's first quality round (doubled by each later one);
    # None: no quality rounds, an interleaved "better" wins on speed alone
    quality_steps: int | None = None
    awaiting: tuple[tuple[Candidate, float], ...] = ()  # faster; quality next (with ratio)
    # what the node runs: a stage's candidates on the best's mesh are checked against it
    # (None: a plan stored before the mesh stage, whose candidates were all checked up front)
    hw: Hardware | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"best": self.best.as_dict(), "feasible": [c.as_dict() for c in self.feasible],
                "steps": self.steps, "max_rounds": self.max_rounds,
                "stage": STAGES[self.stage] if self.stage < len(STAGES) else "done",
                "survivors": None if self.survivors is None
                else [c.as_dict() for c in self.survivors],
                "rounds": [r.as_dict() for r in self.rounds],
                "quality_steps": self.quality_steps,
                "awaiting": [[c.as_dict(), r] for c, r in self.awaiting],
                "hardware": None if self.hw is None else asdict(self.hw)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        surv = d.get("survivors")
        return cls(Candidate.from_dict(d["best"]),
                   tuple(Candidate.from_dict(c) for c in d["feasible"]), d["steps"],
                   d.get("max_rounds", 3), _stage_index(d.get("stage", 0)),
                   None if surv is None else tuple(Candidate.from_dict(c) for c in surv),
                   tuple(Round.from_dict(r) for r in d.get("rounds", ())),
                   d.get("quality_steps"),
                   tuple((Candidate.from_dict(c), float(r)) for c, r in d.get("awaiting", ())),
                   None if d.get("hardware") is None else Hardware(**d["hardware"]))


# Plans stored before the joint stage numbered their stage in this tuple.
_STAGES_BEFORE_JOINT = ("precision", "compression", "bucket")


def _stage_index(stored: object) -> int:
    """A stored plan's stage: by name (or "done"), or an index from before the joint stage."""
    name = _STAGES_BEFORE_JOINT[stored] if isinstance(stored, int) and 0 <= stored < 3 \
        else stored
    if name == "done" or (isinstance(stored, int) and stored >= 3):
        return len(STAGES)
    return STAGES.index(str(name))


def start(feasible: Sequence[Candidate], *, base: Candidate, steps: int,
          max_rounds: int = 3, quality_steps: int | None = None,
          hw: Hardware | None = None) -> Plan:
    """The plan before any round: ``base`` (the job's own setting, compression none) is the
    first best. ``quality_steps``: see ``Plan`` (None: speed rounds only)."""
    if steps < 1:
        raise FieldErrors.at(("steps",), f"must be at least 1 (got {steps})")
    if max_rounds < 1:
        raise FieldErrors.at(("max_rounds",), f"must be at least 1 (got {max_rounds})")
    if quality_steps is not None and quality_steps < 1:
        raise FieldErrors.at(("quality_steps",), f"must be at least 1 (got {quality_steps})")
    return Plan(best=base, feasible=tuple(feasible), steps=steps, max_rounds=max_rounds,
                quality_steps=quality_steps, hw=hw)


def _stage_field(stage: str, c: Candidate, best: Candidate) -> bool:
    """Whether ``c`` differs from ``best`` in this stage's dimension only."""
    if stage == "mesh":
        return c.mesh is not None and c.mesh != best.mesh
    if c.mesh is not None:  # a mesh candidate: the mesh stage's only
        return False
    if stage == "precision":
        return (c.precision != best.precision and c.method == "none"
                and c.bucket_mb == best.bucket_mb)
    if stage == "compression":
        return c.method != "none" and c.bucket_mb is None
    if stage == "joint":
        return c.method != "none" and c.precision != best.precision and c.bucket_mb is None
    return c.bucket_mb is not None and c.bucket_mb != best.bucket_mb


def _in_stage(stage: str, c: Candidate, best: Candidate) -> Candidate | None:
    """``c`` as this stage tries it: the stage's dimension from ``c``, the rest from ``best``
    (compression at the chosen precision; bucket sizes with both chosen; every stage on the
    best's mesh)."""
    if not _stage_field(stage, c, best):
        return None
    if stage == "mesh":
        return replace(best, mesh=c.mesh)
    if stage == "precision":
        return replace(best, precision=c.precision)
    if stage == "compression":
        return Candidate(best.precision, dict(c.compression), best.bucket_mb, best.mesh) \
            if c.precision == best.precision else None
    if stage == "joint":
        return Candidate(c.precision, dict(c.compression), best.bucket_mb, best.mesh)
    return replace(best, bucket_mb=c.bucket_mb)


def _stage_candidates(stage: str, plan: Plan) -> tuple[Candidate, ...]:
    """The stage's challengers against ``plan.best``, each once. The joint stage leaves out
    what an earlier round tried already, and the precisions and methods that showed harm.
    A candidate the best's mesh cannot run (compression on a tp > 1 winner) is left out by
    the rule that left out the infeasible ones at the start."""
    harmful = _harmful(plan) if stage == "joint" else set()
    tried = {n for r in plan.rounds for n in (r.baseline.name, *(c.name for c in r.challengers))}
    seen: dict[str, Candidate] = {}
    for c in plan.feasible:
        cand = _in_stage(stage, c, plan.best)
        if cand is None or cand.name == plan.best.name:
            continue
        if plan.hw is not None and infeasible(cand, plan.hw):
            continue
        if stage == "joint" and (cand.name in tried or {cand.precision, cand.method} & harmful):
            continue
        seen.setdefault(cand.name, cand)
    return tuple(seen.values())


def _harmful(plan: Plan) -> set[str]:
    """The precisions (precision stage) and compression methods (compression stage) whose
    quality was shown harmful: the joint stage does not pair them with anything."""
    out = set()
    for r in plan.rounds:
        if r.stage not in ("precision", "compression"):
            continue
        for c in r.challengers:
            v = (r.verdicts or {}).get(c.name)
            if v is not None and quality_status(v) == "harm":
                out.add(c.precision if r.stage == "precision" else c.method)
    return out


def _done(plan: Plan, stage: str, phase: str) -> int:
    return sum(1 for r in plan.rounds if r.stage == stage and r.phase == phase)


def _quality_tries(plan: Plan, stage: str, c: Candidate) -> int:
    """How many of ``stage``'s quality rounds ``c`` already faced."""
    return sum(1 for r in plan.rounds if r.stage == stage and r.phase == "quality"
               and c.name in (x.name for x in r.challengers))


# An inconclusive challenger whose round measured it at this ratio to the best or below leaves
# the stage (bench/tuner.py, 200 searches per scenario, with per-arm round budgets): keeping it
# doubled the round of an arm not even estimated faster; at 1.0 the null search spent 0.26 of
# the exhaustive budget instead of 0.43 and found-best stayed 94-96% (1.02, min_effect, gave the
# same within 2 points).
PRUNE_AT = 1.0


def round_steps(plan: Plan, stage: str, phase: str, index: int, arms: int,
                carried: Sequence[Round] = ()) -> int:
    """A round's budget: a quality round's steps per trial (``quality_steps``, doubled for each
    quality round of the stage its challengers already faced: ``index``); a forked speed
    round's per trial (``steps``, doubled); an interleaved speed round's for all its ``arms``
    (the baseline included) together: each arm's pairs with the best double from round to
    round (``steps`` per two arms in the first), and those the ``carried`` rounds measured
    count (the round runs the difference)."""
    if phase == "quality":
        assert plan.quality_steps is not None
        return plan.quality_steps * 2 ** index
    per_two = plan.steps * 2 ** index
    if runs_forked(stage, phase):
        return per_two
    per_two -= sum(r.steps * 2 // (1 + len(r.challengers)) for r in carried)
    return max(plan.steps, per_two) * max(2, arms) // 2


def carried_rounds(plan: Plan, stage: str) -> list[Round]:
    """The stage's interleaved speed rounds so far against the best, whose pairs the next
    one carries: every challenger of the next one faced it in each of them (a stage's
    survivors are each round's own, until a new best, which no earlier round measured)."""
    return [r for r in plan.rounds if r.stage == stage and r.phase == "speed" and not r.forked
            and r.baseline.name == plan.best.name and r.experiment_id is not None]


def next_round(plan: Plan) -> tuple[Plan, Round | None]:
    """The next experiment to run, or None when the search is over (``plan.best`` wins)."""
    while plan.stage < len(STAGES):
        stage = STAGES[plan.stage]
        if plan.survivors is None:  # the stage starts: its candidates against the best
            plan = replace(plan, survivors=_stage_candidates(stage, plan))
        quality = _done(plan, stage, "quality")
        if plan.awaiting and plan.quality_steps is not None and quality < plan.max_rounds:
            waiting = tuple(c for c, _ in plan.awaiting)
            # a trial doubles for a challenger whose quality a shorter one did not show, not
            # for a fresh winner that comes after another's quality round
            tries = max(_quality_tries(plan, stage, c) for c in waiting)
            return plan, Round(stage, quality, plan.best, waiting,
                               round_steps(plan, stage, "quality", tries, 1 + len(waiting)),
                               phase="quality", speed={c.name: r for c, r in plan.awaiting},
                               reuse=tuple(r.experiment_id for r in plan.rounds
                                           if r.phase == "quality"
                                           and r.experiment_id is not None))
        plan = replace(plan, awaiting=())  # quality rounds spent: not shown, out
        speed = _done(plan, stage, "speed")
        if plan.survivors and speed < plan.max_rounds:
            carried = carried_rounds(plan, stage)  # none in a forked stage
            return plan, Round(stage, speed, plan.best, tuple(plan.survivors),
                               round_steps(plan, stage, "speed", speed,
                                           1 + len(plan.survivors), carried),
                               carry=tuple(r.experiment_id for r in carried
                                           if r.experiment_id is not None))
        plan = replace(plan, stage=plan.stage + 1, survivors=None)
    return plan, None


def first_rounds(plan: Plan) -> list[Round]:
    """Each stage's first round (speed, and quality where the stage has one) as it would be
    against ``plan.best`` with every stage candidate: the largest experiments of the search
    (later rounds keep at most half the challengers), for the submit to check up front."""
    out = []
    for stage in STAGES:
        challengers = _stage_candidates(stage, plan)
        if not challengers:
            continue
        arms = 1 + len(challengers)
        rnd = Round(stage, 0, plan.best, challengers,
                    round_steps(plan, stage, "speed", 0, arms))
        out.append(rnd)
        if plan.quality_steps is not None and not rnd.forked:
            out.append(replace(rnd, steps=round_steps(plan, stage, "quality", 0, arms),
                               phase="quality"))
    return out


def record(plan: Plan, rnd: Round, verdicts: Mapping[str, Mapping[str, Any]]) -> Plan:
    """``plan`` after round ``rnd`` ended with ``verdicts`` (challenger name -> the verdict
    record: ``kind`` and ``ratio`` at least; ``quality.status`` in a quality round). A
    challenger without a verdict counts as failed."""
    rnd = replace(rnd, verdicts={k: dict(v) for k, v in verdicts.items()})
    plan = replace(plan, rounds=(*plan.rounds, rnd))
    if rnd.phase == "quality":
        return _record_quality(plan, rnd, verdicts)
    best, ranked = plan.best, []
    winners = []
    for c in rnd.challengers:
        v = verdicts.get(c.name) or {"kind": "failed (error)"}
        ratio = _ratio(v)
        if v.get("kind") == "better":
            winners.append((ratio, c))
        elif v.get("kind") not in _OUT and (ratio > PRUNE_AT or v.get("ratio") is None):
            ranked.append((ratio, c))  # inconclusive or not shown: it may yet be better
    winners.sort(key=lambda rc: -rc[0])
    ranked.sort(key=lambda rc: -rc[0])
    keep = math.ceil(len(rnd.challengers) / 2)
    if winners and plan.quality_steps is not None and not rnd.forked:
        # faster on shared weights: each faces a quality round on its own weights first
        return replace(plan, awaiting=tuple((c, r) for r, c in winners),
                       survivors=tuple(c for _, c in ranked[:keep]))
    if winners:
        best = winners[0][1]
        ranked = [*winners[1:], *ranked]  # beat the old best too: worth a round against the new
    return replace(plan, best=best, survivors=tuple(c for _, c in ranked[:keep]))


def _record_quality(plan: Plan, rnd: Round, verdicts: Mapping[str, Mapping[str, Any]]) -> Plan:
    """The fastest challenger whose quality is shown becomes the best; see the module doc."""
    speed = dict(rnd.speed or {})
    passed, unshown = [], []
    for c in sorted(rnd.challengers, key=lambda c: -speed.get(c.name, 0.0)):
        v = verdicts.get(c.name) or {"kind": "failed (error)"}
        status = quality_status(v)
        if status == "non-inferior":
            passed.append(c)
        elif status == "not shown":
            unshown.append(c)
    if not passed:  # a longer quality round for those not shown yet (next_round caps them)
        return replace(plan, awaiting=tuple((c, speed.get(c.name, 0.0)) for c in unshown))
    # the others beat the old best on speed: they face the new one
    survivors = {c.name: c for c in (*passed[1:], *unshown, *(plan.survivors or ()))}
    return replace(plan, best=passed[0], awaiting=(), survivors=tuple(survivors.values()))


def quality_status(v: Mapping[str, Any]) -> str | None:
    """A forked verdict's quality: ``non-inferior``, ``harm`` or ``not shown``; None when the
    trials failed (no quality was measured, and a failure is not evidence either way)."""
    if v.get("kind") == "failed (error)":
        return None
    if v.get("kind") == "rejected (quality)":
        return "harm"
    q = v.get("quality")
    status = q.get("status") if isinstance(q, Mapping) else None
    return str(status) if status in ("non-inferior", "harm") else "not shown"


def _ratio(v: Mapping[str, Any]) -> float:
    r = v.get("ratio")
    return float(r) if isinstance(r, int | float) and math.isfinite(r) else 0.0
