"""The auto-tuner on a simulated arm space with known true ratios (traind issue 14).

    python bench/tuner.py                         # 4 scenarios x 50 searches, a few minutes
    python bench/tuner.py --quick                 # 4 x 3 searches (the test's path)
    python bench/tuner.py --searches 200 --json /tmp/tuner.json

**What runs for real.** The plan is the tuner's own: ``search.candidates``, ``start``,
``next_round`` and ``record`` (``daemon/autotune/search.py``), with the defaults of
``AutotuneSpec`` (speed rounds of 400 steps per two arms, blocks of 20 with 3 warm-up steps,
3 rounds per stage and phase, quality rounds of 100 steps x 4 repeats, margin 0.05 nats, min
effect and equivalence 2%). Every verdict is the daemon's statistics on simulated measurements:

- a speed round (interleaved) makes blocks in the trainer's order (``interleave.arm_index``:
  A B C | C B A | ...), judges them with ``ab.evaluate`` after every block and keeps each arm's
  first decision (``interleaved.settle``), as the node does; the run stops once every arm is
  decided (``interleaved.decided``), else at its budget with ``finished=True``. Its cost: the
  blocks run x block steps.
- a forked round (every quality round; a bucket stage's speed rounds, none here) makes one
  result per trial, ``repeats`` trials per arm in balanced order (A B | B A), and judges them
  with ``forked.judge``. Its cost: the trials it runs x steps, + the base job that makes the
  starting checkpoint (``forked.MIN_BASE_STEPS``). A search's quality rounds share the first
  one's checkpoint and take the trials an earlier one ran of an arm at the same length
  (``Round.reuse``, ``daemon/experiments/reuse.py``): those cost nothing again and give the
  same results again.

**The space**: precision fp32 / bf16 x compression none / int8 / powersgd (rank 4) / topk (1%,
no error feedback) on ``Hardware(cpu, 2 ranks, ddp)`` (compression feasible): 8 candidates,
baseline ``fp32.none``. Each scenario gives every candidate a true throughput ratio against the
baseline and a true loss effect (nats, 0 unless said); int8 halves fp32's gradient bytes but
gains little at bf16, whose gradient is half the bytes already (the interaction), and topk
without error feedback is fast but costs +0.10 nats. The **true best** is the fastest
candidate whose loss effect is under the margin, and the baseline when that one is less than
``min_effect`` faster (a gain the tuner is told is not worth a change). The ``interaction``
scenario's true best needs precision and compression chosen together: the first two stages
(precision first, at compression none) never try it, the joint stage does.

**The noise** (``Noise``): per block, ``stats.simulate_blocks``'s model of this machine (its
slow drift and 2% of blocks hit by another tenant, defaults read from that function), with the
independent part set so one pair's log ratio has sd ``--pair-sd`` (0.08, measured here by
bench/ab_calibration.py; with the drift and the hit blocks a pair's plain sd comes to ~0.10,
which the verdict's robust clipping mostly takes out). Block training loss: a falling
power-law curve + the arm's effect (all of it, in its own blocks: the interleaved guard's best
case) + noise of sd 0.067 nats per pair. A forked trial: throughput over its steps (the same
block model, run for the trial's length), validation loss = 2.5 + the arm's effect + noise
of sd 0.024 nats per pair (``--val-sd``, measured here), the same at every trial length (the
conservative choice). Compression's relative gradient error per block is fixed per method,
all under the guard's bound of 1.

**The exhaustive equal-allocation schedule** the budget is compared with, per search: every
challenger (7) in an A/B of its own against the baseline, no early stopping: an interleaved
one of 2 x P steps, P the most steps per arm behind any one speed verdict of the search, at
full budgets (a round's own and those of the rounds whose pairs it carried: 200 + 200 + 400
over a stage's three rounds, as the last round alone had before rounds carried their
pairs), and a forked quality one of 2 arms x repeats x T steps + the
base job, T the tuner's longest quality trial (its first, if it ran none). ``ratio``: tuner
steps / exhaustive steps, the median over searches (goal <= 1/3). ``shared`` is the cheaper
reading, all 8 arms in one job of each kind (the baseline run once): 8 x P + 8 x repeats x T
+ the base job.

**Regret** = true best ratio / chosen ratio - 1 over the searches that chose a harmless
candidate; a harmful choice is counted in ``harmful chosen`` instead. A **decision** is one
search's choice; a **verdict** one challenger's outcome in one round. Decisions per week =
one week / (``--seconds-per-step`` x median steps + ``--seconds-per-job`` x median jobs per
search); the default 0.1375 s/step is bench/ab_calibration.py's default job on this machine
(480 steps in ~66 s, its start-up included), and a job's start-up is not counted beyond that
(0 s; every forked trial is a job of its own, so a quality round of 2 arms x 2 repeats is 5).

Result (``--searches 200``, the defaults of then: 200 steps, 2 quality repeats, ~80 s here):
found the best in 18%, 98%, 22% and 12% of
the bf16-wins, null, harmful-fastest and interaction searches (goal 90%: only null passes), a
harmful arm chosen in none, budget ratio 0.30-0.33 pairwise (0.53-0.58 shared). Why, from the
``why`` lines: the first speed round (200 steps: 5 pairs of 2 arms, 2 of 4) is too short for
the always-valid interval to have any bound (it needs 6 pairs), 34-40% of all speed rounds;
and a quality round of 2 repeats is a paired t with 1 degree of freedom (t 6.31), so a
harmless arm is shown non-inferior in only 29-41% of them and a faster harmless winner never
passes in 24-37% of searches (the search then keeps the old best: regret up to 50%). With
``--quality-repeats 4 --steps 400``, the defaults since (``daemon/service.py``'s TUNE_*): 88%
(83-92%), 94% (90-97%), 88% (82-92%) and 0% (the interaction's best is out of the stages'
reach; they find its staged best in 48%), no harmful choice, ratio 0.24-0.31 (shared 0.41-0.54).
With the joint stage (then limited to 2 speed rounds): 88% (83-92%), 94% (90-97%), 88% (82-92%)
and 90% (85-94%), no harmful choice, ratio 0.26, 0.37, 0.27 and 0.35 (shared 0.46-0.65): the
interaction is found, and the searches with no interaction pay for looking (null 0.37: over
the 1/3 goal). A round's equivalence band is the spec's fixed 2%: left to the node (its budget
at the noise, as an experiment's may be: +-19% at 10 pairs) it called 7-13% faster arms "no
difference" and found the best in 58%, 98%, 78% and 24%.

Then (``--searches 500``): a speed round's budget is per arm (``search.round_steps``: 400 steps
per two arms, so a first round of 4 arms runs 800 and each arm gets 10 pairs; it used to get 5,
too few for the always-valid interval to have any bound, in 14-20% of all speed rounds), an
inconclusive arm measured no faster than the best leaves (``search.PRUNE_AT``), and the joint
stage runs as many rounds as any stage: found 93% (91-95%), 94% (92-96%), 95% (93-97%) and 97%
(95-98%), no harmful choice, ratio 0.31, 0.25, 0.29 and 0.39 (shared 0.44-0.68). Every found
goal passes, and the budget goal in three scenarios of four: the interaction search finds a
winner in every stage, and each winner's forked quality round (2 arms x 4 repeats x 100 steps)
is 40% of its steps.

Then (``--searches 500``): a search's quality rounds share one checkpoint and take the trials
an earlier one ran (the best so far, each round's baseline, is trained once per search), and a
fresh winner's trials are ``quality_steps`` long (they doubled for any second quality round of
a stage): the quality rounds' mean steps fell 39%, 32% and 38% (bf16-wins 2,748 -> 1,709,
harmful-fastest 2,203 -> 1,491, interaction 3,584 -> 2,195), all steps 12-19% (medians 5,250
-> 4,270, 5,230 -> 4,590, 7,270 -> 6,090; null runs no quality round). Found 94%
(92-96%), 94% (92-96%), 95% (92-97%), 97% (95-98%), no harmful choice; ratio 0.30, 0.26, 0.32,
**0.36** (shared 0.46-0.63). The interaction search still misses 1/3: its speed rounds alone
are 0.35 of the exhaustive schedule's (3,890 steps against 11,200: it runs a third stage, the
joint, whose winner is the true best), and its quality rounds 0.39 (2,195 against 5,670:
five settings each trained once, of the exhaustive schedule's seven pairs).

Now (``--searches 500``): a speed round carries the pairs the stage's earlier rounds measured
against the same best (``search.Round.carry``; ``ab.evaluate(prior=...)`` reads them and its
own as one always-valid stream) and runs only what doubles each arm's pairs: 10, 20, 40 pairs
per arm over three rounds in 10 + 10 + 20 pairs' steps. Steps (medians) 4,270 -> 3,810,
3,800 -> 3,000, 4,590 -> 4,010, 6,090 -> 4,770; found 92% (89-94%), 94% (92-96%), 95%
(93-97%), 98% (96-99%), no harmful choice; ratio 0.26, 0.21, 0.29, 0.29 (shared 0.37-0.52):
every goal passes. bf16-wins found 2 points fewer (94% before): an arm that survives a round
was unlucky in it, and those pairs stay in its evidence where a fresh round forgot them. The
ratio's denominator counts the carried evidence (P above): measured against the old reading,
the tuner's largest single round per arm (400 now), the same searches' exhaustive schedule
would be 11,270 steps and the interaction ratio 0.42, but that schedule would give each arm
half the pairs the tuner's closest verdict rests on.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from ab_calibration import clopper_pearson  # bench/ is on sys.path when this runs as a script

from traind.daemon.autotune import search
from traind.daemon.autotune.runner import round_spec
from traind.daemon.autotune.search import Candidate, Hardware, Space
from traind.daemon.db.queue import TrialView
from traind.daemon.experiments import ab, bands, forked, stats
from traind.daemon.experiments.interleaved import decided, settle
from traind.daemon.experiments.reuse import counted_pairs
from traind.daemon.service import AutotuneSpec, ExperimentInfo
from traind.trainer.interleave import arm_index

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from traind.daemon.autotune.search import Plan, Round

COMPRESSIONS = ({"method": "none"}, {"method": "int8"},
                {"method": "powersgd", "powersgd_rank": 4},
                {"method": "topk", "topk_ratio": 0.01, "error_feedback": False})
SPACE = Space(precisions=("fp32", "bf16"), compressions=COMPRESSIONS)
HARDWARE = Hardware(device="cpu", ranks=2, strategy="ddp")
BASE = Candidate("fp32", {"method": "none"})
SPEC = AutotuneSpec(name="bench")  # the tuner's defaults (one home); --quality-repeats etc.
# relative gradient error per block (ab.guard rejects above 1): assumed, all pass the bound
GRAD_ERROR = {"none": 0.0, "int8": 0.004, "powersgd": 0.5, "topk": 0.9}
TOKENS_PER_STEP = 1024  # any figure: verdicts read ratios only
WEEK_S = 7 * 24 * 3600
GOAL_FOUND, GOAL_BUDGET = 0.90, 1 / 3
_SIM = inspect.signature(stats.simulate_blocks).parameters  # the machine model's home


@dataclass(frozen=True, slots=True)
class Noise:
    """The simulated machine (see the module docstring)."""

    pair_sd: float = 0.08  # sd of one pair's log throughput ratio (independent part)
    drift: float = _SIM["drift"].default
    drift_period: float = _SIM["drift_period"].default  # pairs
    hiccup: float = _SIM["hiccup"].default
    loss_pair_sd: float = 0.067  # nats, block training loss, per pair
    val_pair_sd: float = 0.024  # nats, validation loss of forked trials, per pair
    level: float = 8000.0  # tokens/s of the baseline


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    about: str
    ratio: Mapping[str, float]  # "precision.method" -> true throughput ratio vs fp32.none
    harm: Mapping[str, float] = field(default_factory=dict)  # -> loss effect, nats (else 0)


_TOPK_HARM = {"fp32.topk": 0.10, "bf16.topk": 0.10}
SCENARIOS = (
    Scenario("bf16-wins", "bf16 1.40x; powersgd +7% on top is the best",
             {"fp32.none": 1.0, "fp32.int8": 1.12, "fp32.powersgd": 1.08, "fp32.topk": 1.20,
              "bf16.none": 1.40, "bf16.int8": 1.41, "bf16.powersgd": 1.50, "bf16.topk": 1.62},
             _TOPK_HARM),
    Scenario("null", "nothing beats fp32.none by 2%: keep it",
             {"fp32.none": 1.0, "fp32.int8": 0.99, "fp32.powersgd": 0.97, "fp32.topk": 1.01,
              "bf16.none": 1.01, "bf16.int8": 0.98, "bf16.powersgd": 0.96, "bf16.topk": 1.00},
             _TOPK_HARM),
    Scenario("harmful-fastest", "topk 1.35x but +0.10 nats; int8 1.10x is the best",
             {"fp32.none": 1.0, "fp32.int8": 1.10, "fp32.powersgd": 1.05, "fp32.topk": 1.35,
              "bf16.none": 0.95, "bf16.int8": 0.96, "bf16.powersgd": 0.93, "bf16.topk": 1.25},
             _TOPK_HARM),
    Scenario("interaction", "fp32.int8 1.30x beats bf16 (1.15x) with anything",
             {"fp32.none": 1.0, "fp32.int8": 1.30, "fp32.powersgd": 1.10, "fp32.topk": 1.40,
              "bf16.none": 1.15, "bf16.int8": 1.16, "bf16.powersgd": 1.20, "bf16.topk": 1.45},
             _TOPK_HARM),
)


# -- the truth -------------------------------------------------------------------------------


def key(c: Candidate) -> str:
    return f"{c.precision}.{c.method}"


def true_best(s: Scenario, feasible: Sequence[Candidate], *, margin: float,
              min_effect: float) -> Candidate:
    """The fastest harmless candidate; the baseline when that is not worth a change."""
    ok = [c for c in feasible if s.harm.get(key(c), 0.0) < margin]
    best = max(ok, key=lambda c: s.ratio[key(c)])
    return best if s.ratio[key(best)] >= 1 + min_effect else BASE


def staged_best(s: Scenario, feasible: Sequence[Candidate], *, margin: float,
                min_effect: float) -> Candidate:
    """What the tuner's stages reach with every verdict right: the fastest harmless precision
    at compression none, then the fastest harmless compression at that precision, then the
    fastest harmless combination of the others (the joint stage; it pairs no method that
    showed harm), each only when ``min_effect`` faster than the best so far (an oracle of the
    stage order, not of its statistics: where it differs from :func:`true_best` the stages
    cannot find that)."""
    best = BASE
    for stage in ("precision", "compression", "joint"):
        ok = [c for c in feasible if s.harm.get(key(c), 0.0) < margin
              and {"precision": c.method == "none", "compression": c.precision == best.precision,
                   "joint": c.method != "none"}[stage]]
        top = max(ok, key=lambda c: s.ratio[key(c)])
        if s.ratio[key(top)] >= (1 + min_effect) * s.ratio[key(best)]:
            best = top
    return best


# -- the simulated machine -------------------------------------------------------------------


def log_speed(n_slots: int, noise: Noise, rng: np.random.Generator) -> np.ndarray:
    """Log speed factor per block slot: ``stats.simulate_blocks``'s drift, noise and hiccups,
    for any number of arms (there, two slots make a pair)."""
    t = np.arange(n_slots) / 2.0
    walk = np.cumsum(rng.normal(0, noise.drift / 10, n_slots))
    out = noise.drift * np.sin(2 * np.pi * t / noise.drift_period + rng.uniform(0, 2 * np.pi))
    sigma = noise.pair_sd / math.sqrt(2)  # two independent blocks per pair
    out = out + walk + rng.normal(-sigma * sigma / 2, sigma, n_slots)
    hit = rng.random(n_slots) < noise.hiccup
    return out + np.where(hit, np.log1p(-rng.uniform(0.1, 0.4, n_slots)), 0.0)


def train_loss(step: float) -> float:
    """The shared training-loss curve: power-law-like, steep then flat."""
    return 2.0 + 3.0 * (1 + step / 50) ** -0.5


def equivalence(rnd: Round, spec: AutotuneSpec, noise: Noise) -> float:
    """The round's band as the node sets it at submission (``bands.resolve`` of the round's
    experiment, ``runner.round_spec``), on a node that measured ``noise.pair_sd``."""
    measured = ExperimentInfo(id=0, name="measured", state="done", mode="interleaved",
                              arms=("a", "b"), run_id=None, config_hash="", versions={},
                              verdict={"b": {"noise": noise.pair_sd, "pairs": 100}},
                              created_at=datetime.now(UTC), finished_at=None)
    resolved, _ = bands.resolve(round_spec(spec, 0, rnd), [measured])
    assert resolved.equivalence is not None
    return resolved.equivalence


# experiment id -> {arm: the log ratios of the pairs its verdict counted, carried ones aside}:
# the pairs a search's speed rounds measured, which a later one against the same best carries
# (search.Round.carry, daemon/experiments/reuse.py's carried_pairs)
Pairs = dict[int, dict[str, list[float]]]


def speed_round(rnd: Round, s: Scenario, noise: Noise, rng: np.random.Generator,
                spec: AutotuneSpec, measured: Pairs | None = None
                ) -> tuple[dict[str, Any], int]:
    """An interleaved round as the node runs it: (verdicts, steps used). ``measured``: the
    search's rounds' pairs so far, where the round's own go too (under its experiment id)."""
    measured = {} if measured is None else measured
    prior = {c.name: [x for i in rnd.carry for x in measured[i].get(c.name, ())]
             for c in rnd.challengers}
    arms = [rnd.baseline, *rnd.challengers]
    names = [c.name for c in arms]
    bs = spec.block_steps
    n_blocks = rnd.steps // bs
    speed = log_speed(n_blocks, noise, rng)
    tokens = (bs - spec.warmup_steps) * TOKENS_PER_STEP
    loss_sd = noise.loss_pair_sd / math.sqrt(2)
    blocks: list[ab.Block] = []
    verdict: dict[str, Any] = {}

    band = equivalence(rnd, spec, noise)

    def judge(finished: bool) -> dict[str, Any]:
        return ab.evaluate(blocks, names, finished=finished, loss_margin=spec.loss_margin,
                           min_effect=spec.min_effect, equivalence=band, prior=prior)

    def ended(step: int) -> tuple[dict[str, Any], int]:
        if rnd.experiment_id is not None:
            measured[rnd.experiment_id] = {  # what reuse.carried_pairs takes of a source
                c.name: counted_pairs(blocks, names, c.name, verdict[c.name])
                for c in rnd.challengers}
        return verdict, step

    for b in range(n_blocks):
        c = arms[arm_index(b, len(arms))]
        tput = noise.level * s.ratio[key(c)] * math.exp(speed[b])
        loss = (train_loss((b + 0.5) * bs) + s.harm.get(key(c), 0.0)
                + rng.normal(0, loss_sd))
        blocks.append(ab.Block(c.name, b, tokens, tokens / tput, loss, GRAD_ERROR[c.method]))
        step = (b + 1) * bs
        verdict = settle(verdict, judge(False), step=step, budget_steps=rnd.steps)
        if decided(verdict):  # the node stops the run here
            return ended(step)
    verdict = settle(verdict, judge(True), step=n_blocks * bs, budget_steps=rnd.steps,
                     finished=True)
    return ended(n_blocks * bs)


# (candidate, steps, repeat) -> (tokens/s, validation loss): the trials a search's quality
# rounds have run from their shared checkpoint, which later ones take (search.Round.reuse)
Trials = dict[tuple[str, int, int], tuple[float, float]]


def forked_round(rnd: Round, s: Scenario, noise: Noise, rng: np.random.Generator,
                 spec: AutotuneSpec, *, repeats: int, ran: Trials | None = None
                 ) -> tuple[dict[str, Any], int]:
    """A forked round: one result per trial, judged by ``forked.judge``. ``ran``: the
    search's trials so far (a quality round's, ``rnd.reuse``): one there is taken, not run, and
    the base job runs only if there is none (the first round's checkpoint starts them all)."""
    ran = {} if ran is None else ran
    first = not ran
    arms = [rnd.baseline, *rnd.challengers]
    order = [(r, i) for r in range(repeats)
             for i in (range(len(arms)) if r % 2 == 0 else reversed(range(len(arms))))]
    per_trial = max(1, rnd.steps // spec.block_steps)  # a trial: its steps' worth of blocks
    speed = log_speed(len(order) * per_trial, noise, rng)
    val_sd = noise.val_pair_sd / math.sqrt(2)
    trials, steps = [], forked.MIN_BASE_STEPS if first else 0
    for slot, (r, i) in enumerate(order):
        c = arms[i]
        done = ran.get((c.name, rnd.steps, r))
        if done is None:
            seg = speed[slot * per_trial:(slot + 1) * per_trial]
            tps = noise.level * s.ratio[key(c)] / float(np.mean(np.exp(-seg)))  # tokens / s
            done = (tps, 2.5 + s.harm.get(key(c), 0.0) + rng.normal(0, val_sd))
            ran[(c.name, rnd.steps, r)] = done
            steps += rnd.steps
        tps, val = done
        trials.append(TrialView(slot, 0, i, c.name, r, "done", 1, slot, None,
                                {"tokens_per_second": tps, "val_loss": val,
                                 "loss": val, "steps": rnd.steps}, None))
    verdict = forked.judge([c.name for c in arms], trials, loss_margin=spec.loss_margin,
                           min_effect=spec.min_effect, equivalence=equivalence(rnd, spec, noise))
    return verdict, steps


# -- one search ------------------------------------------------------------------------------


def exhaustive_steps(plan: Plan, n_candidates: int, *, repeats: int,
                     shared: bool = False) -> int:
    """The equal-allocation schedule's steps (see the module docstring): pairwise, every
    challenger in A/Bs of its own against the baseline (``shared``: all arms in one job)."""
    speed = [r for r in plan.rounds if not r.forked]
    by_id = {r.experiment_id: r for r in speed if r.experiment_id is not None}

    def evidence(r: Round) -> int:  # the steps per arm behind its verdicts, carried included
        return sum(c.steps // (1 + len(c.challengers))
                   for c in (*(by_id[i] for i in r.carry), r))

    per_arm = max(map(evidence, speed), default=plan.steps)
    trial = max((r.steps for r in plan.rounds if r.phase == "quality"),
                default=plan.quality_steps or 0)
    quality = plan.quality_steps is not None
    if shared:
        return n_candidates * per_arm + (
            n_candidates * repeats * trial + forked.MIN_BASE_STEPS if quality else 0)
    one = 2 * per_arm + (2 * repeats * trial + forked.MIN_BASE_STEPS if quality else 0)
    return (n_candidates - 1) * one


def round_record(rnd: Round, verdicts: Mapping[str, Any], used: int, spec: AutotuneSpec
                 ) -> dict[str, Any]:
    """What the table's diagnostics read of a round. ``bounded``: whether a speed round's
    budget holds enough pairs per arm for the always-valid interval to have any bound (it has
    none below ~6 pairs, whatever the noise: such a round can only end inconclusive on speed)."""
    arms = 1 + len(rnd.challengers)
    pairs = rnd.steps // spec.block_steps // arms
    out: dict[str, Any] = {
        "stage": rnd.stage, "phase": rnd.phase, "budget": rnd.steps, "used": used,
        "baseline": rnd.baseline.name,
        "arms": {c.name: key(c) for c in rnd.challengers},
        "kinds": {k: v.get("kind") for k, v in verdicts.items()}}
    if rnd.phase == "quality":
        out["status"] = {k: search.quality_status(v) for k, v in verdicts.items()}
    elif not rnd.forked:
        out["bounded"] = math.isfinite(stats.sequence_half_width(pairs, 1.0))
    return out


def run_search(s: Scenario, noise: Noise, seed: Sequence[int], spec: AutotuneSpec = SPEC
               ) -> dict[str, Any]:
    """One search of scenario ``s``: the tuner's choice, its cost and its truth."""
    rng = np.random.default_rng(list(seed))
    feasible, _ = search.candidates(SPACE, HARDWARE)
    plan = search.start(feasible, base=BASE, steps=spec.steps, max_rounds=spec.max_rounds,
                        quality_steps=spec.quality_steps or None)
    steps, verdicts, jobs, rounds = 0, 0, 0, []
    ran: Trials = {}  # the quality rounds' trials (search.Round.reuse)
    measured: Pairs = {}  # the speed rounds' pairs (search.Round.carry)
    while True:
        plan, rnd = search.next_round(plan)
        if rnd is None:
            break
        rnd = dataclasses.replace(rnd, experiment_id=len(rounds))  # as the runner numbers it
        if rnd.forked:  # a job per trial run, and the base job if one ran
            quality = rnd.phase == "quality"
            v, used = forked_round(rnd, s, noise, rng, spec, ran=ran if quality else None,
                                   repeats=spec.quality_repeats if quality else spec.repeats)
            jobs += math.ceil(used / rnd.steps)  # the base job's few steps round up to one
        else:  # one job
            v, used = speed_round(rnd, s, noise, rng, spec, measured)
            jobs += 1
        plan = search.record(plan, rnd, v)
        steps += used
        verdicts += len(rnd.challengers)
        rounds.append(round_record(rnd, v, used, spec))
    best = true_best(s, feasible, margin=spec.loss_margin, min_effect=spec.min_effect)
    staged = staged_best(s, feasible, margin=spec.loss_margin, min_effect=spec.min_effect)
    chosen = plan.best
    harmful = s.harm.get(key(chosen), 0.0) >= spec.loss_margin
    return {"chosen": key(chosen), "true_best": key(best), "found": key(chosen) == key(best),
            "staged_best": key(staged), "found_staged": key(chosen) == key(staged),
            "harmful": harmful,
            "regret": None if harmful else s.ratio[key(best)] / s.ratio[key(chosen)] - 1,
            "steps": steps, "verdicts": verdicts, "jobs": jobs,
            "exhaustive": exhaustive_steps(plan, len(feasible), repeats=spec.quality_repeats),
            "exhaustive_shared": exhaustive_steps(plan, len(feasible),
                                                  repeats=spec.quality_repeats, shared=True),
            "rounds": rounds}


# -- the table -------------------------------------------------------------------------------


def diagnose(s: Scenario, runs: Sequence[dict[str, Any]], spec: AutotuneSpec) -> dict[str, Any]:
    """Where searches go wrong: speed rounds too short to bound a ratio, quality rounds that
    pass harmless arms (or show harm of harmful ones) only so often, and searches in which a
    harmless speed winner never passed a quality round of its stage."""
    def harmless(k: str) -> bool:
        return s.harm.get(k, 0.0) < spec.loss_margin

    speed = [rd for r in runs for rd in r["rounds"] if "bounded" in rd]
    quality = [(rd["arms"][name], st) for r in runs for rd in r["rounds"]
               if rd["phase"] == "quality" for name, st in rd["status"].items()]
    ok = [st for k, st in quality if harmless(k)]
    bad = [st for k, st in quality if not harmless(k)]
    lost = 0
    for r in runs:
        entered, passed = set(), set()
        for rd in r["rounds"]:
            if rd["phase"] == "quality":
                for name, st in rd["status"].items():
                    if harmless(rd["arms"][name]):
                        entered.add((rd["stage"], name))
                        if st == "non-inferior":
                            passed.add((rd["stage"], name))
        lost += bool(entered - passed)
    return {"found_staged": sum(r["found_staged"] for r in runs) / len(runs),
            "staged_best": runs[0]["staged_best"],
            "speed_rounds": len(speed),
            "unbounded": sum(not rd["bounded"] for rd in speed) / max(1, len(speed)),
            "quality_harmless": len(ok),
            "quality_pass": ok.count("non-inferior") / max(1, len(ok)),
            "quality_harmful": len(bad),
            "quality_harm": bad.count("harm") / max(1, len(bad)),
            "winner_lost": lost / len(runs)}


def summarise(s: Scenario, runs: Sequence[dict[str, Any]], spec: AutotuneSpec, *,
              seconds_per_step: float, seconds_per_job: float = 0.0) -> dict[str, Any]:
    n = len(runs)
    found = sum(r["found"] for r in runs)
    regrets = [r["regret"] for r in runs if r["regret"] is not None]
    steps = statistics.median(r["steps"] for r in runs)
    jobs = statistics.median(r["jobs"] for r in runs)
    seconds = seconds_per_step * steps + seconds_per_job * jobs
    per_verdict = statistics.median(r["steps"] / max(1, r["verdicts"]) for r in runs)
    ratio = statistics.median(r["steps"] / r["exhaustive"] for r in runs)
    shared = statistics.median(r["steps"] / r["exhaustive_shared"] for r in runs)
    chosen: dict[str, int] = {}
    for r in runs:
        chosen[r["chosen"]] = chosen.get(r["chosen"], 0) + 1
    return {"scenario": s.name, "about": s.about, "searches": n,
            "true_best": runs[0]["true_best"], "found": found / n,
            "found_ci": clopper_pearson(found, n),
            "harmful": sum(r["harmful"] for r in runs) / n,
            "regret_mean": statistics.fmean(regrets) if regrets else None,
            "regret_worst": max(regrets) if regrets else None,
            "steps_median": steps,
            "exhaustive_median": statistics.median(r["exhaustive"] for r in runs),
            "budget_ratio": ratio, "budget_ratio_shared": shared,
            "steps_per_verdict": per_verdict,
            "chosen": dict(sorted(chosen.items(), key=lambda kv: -kv[1])),
            "jobs_median": jobs, "seconds_per_search": seconds,
            "searches_per_week": WEEK_S / seconds,
            "verdicts_per_week": WEEK_S / (seconds_per_step * per_verdict),
            "goal_found": found / n >= GOAL_FOUND, "goal_budget": ratio <= GOAL_BUDGET,
            "why": diagnose(s, runs, spec)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{round(x, 3) + 0.0:.1%}"  # no "-0.0%"


def table(rows: Sequence[dict[str, Any]], *, seconds_per_step: float,
          seconds_per_job: float = 0.0) -> str:
    def ok(flag: bool) -> str:
        return "pass" if flag else "FAIL"

    out = [f"{'scenario':<16} {'true best':<14} {'found best (95% CI)':<22} {'harmful':>7} "
           f"{'regret mean':>11} {'worst':>6} {'tuner':>6} {'exhaust':>7} {'ratio':>5} "
           f"{'shared':>6} {'/verdict':>8}  goals (found >= 90%, ratio <= 1/3)"]
    for r in rows:
        lo, hi = r["found_ci"]
        found = f"{r['found']:.0%} ({lo:.0%}-{hi:.0%}) n={r['searches']}"
        out.append(
            f"{r['scenario']:<16} {r['true_best']:<14} {found:<22} "
            f"{r['harmful']:>7.0%} {_pct(r['regret_mean']):>11} {_pct(r['regret_worst']):>6} "
            f"{r['steps_median']:>6.0f} {r['exhaustive_median']:>7.0f} "
            f"{r['budget_ratio']:>5.2f} {r['budget_ratio_shared']:>6.2f} "
            f"{r['steps_per_verdict']:>8.0f}  "
            f"found {ok(r['goal_found'])}, budget {ok(r['goal_budget'])}")
    out.append("tuner/exhaust: median steps; ratio: median of tuner/exhaustive per search "
               "(pairwise A/Bs); shared: the same with all arms in one job; regret over "
               "harmless choices")
    out.append("\nchosen (count): " + "; ".join(
        f"{r['scenario']}: " + ", ".join(f"{k} {v}" for k, v in r["chosen"].items())
        for r in rows))
    out.append("\nwhy (speed rounds whose budget holds too few pairs per arm for any interval; "
               "quality rounds: harmless arms shown non-inferior, harmful ones shown harm; "
               "searches where a harmless speed winner never passed its stage's quality "
               "rounds):")
    for r in rows:
        w = r["why"]
        out.append(
            f"  {r['scenario']:<16} staged best {w['staged_best']} found {w['found_staged']:.0%}"
            f"; unbounded speed rounds {w['unbounded']:.0%} of {w['speed_rounds']}"
            f"; quality pass {w['quality_pass']:.0%} of {w['quality_harmless']}"
            f", harm shown {w['quality_harm']:.0%} of {w['quality_harmful']}"
            f"; winner lost in {w['winner_lost']:.0%} of searches")
    out.append(f"\ndecisions per week one CPU node could make at {seconds_per_step:g} s/step "
               f"and {seconds_per_job:g} s of start-up per job (medians):")
    for r in rows:
        hours = r["seconds_per_search"] / 3600
        out.append(f"  {r['scenario']:<16} {r['searches_per_week']:7.1f} searches "
                   f"({r['steps_median']:.0f} steps in {r['jobs_median']:.0f} jobs, "
                   f"{hours:.2f} h each), {r['verdicts_per_week']:7.0f} arm verdicts "
                   f"({r['steps_per_verdict']:.0f} steps each)")
    return "\n".join(out)


def space_text(scenarios: Sequence[Scenario]) -> str:
    names = [key(Candidate(p, dict(m))) for p in SPACE.precisions for m in COMPRESSIONS]
    out = [f"space: {', '.join(names)} on {HARDWARE}; true ratio vs {key(BASE)} "
           "(loss effect, nats, if any):"]
    for s in scenarios:
        out.append(f"  {s.name:<16} " + "  ".join(
            f"{n} {s.ratio[n]:.2f}" + (f" ({s.harm[n]:+.2f})" if n in s.harm else "")
            for n in names) + f"  -- {s.about}")
    return "\n".join(out)


def tuner_text(spec: AutotuneSpec) -> str:
    keys = ("steps", "max_rounds", "block_steps", "warmup_steps", "loss_margin", "min_effect",
            "equivalence", "quality_steps", "quality_repeats")
    return ", ".join(f"{k} {getattr(spec, k)}" for k in keys)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--searches", type=int, default=50, help="searches per scenario")
    p.add_argument("--quick", action="store_true", help="3 searches per scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenario", action="append", choices=[s.name for s in SCENARIOS],
                   help="only these (repeatable)")
    p.add_argument("--pair-sd", type=float, default=Noise().pair_sd,
                   help="sd of a pair's log throughput ratio")
    p.add_argument("--val-sd", type=float, default=Noise().val_pair_sd,
                   help="sd of a pair's validation-loss difference (nats)")
    p.add_argument("--seconds-per-step", type=float, default=66 / 480,
                   help="the default job's seconds per step on the node")
    p.add_argument("--seconds-per-job", type=float, default=0.0,
                   help="start-up per job beyond --seconds-per-step's (a forked trial is one)")
    p.add_argument("--quality-repeats", type=int, default=SPEC.quality_repeats,
                   help="trials per arm of a quality round (the tuner's setting)")
    p.add_argument("--steps", type=int, default=SPEC.steps,
                   help="the first speed round's budget (the tuner's setting)")
    p.add_argument("--json", help="save the results here")
    args = p.parse_args(argv)
    spec = dataclasses.replace(SPEC, quality_repeats=args.quality_repeats, steps=args.steps)
    n = 3 if args.quick else args.searches
    if n < 1:
        p.error("--searches: at least 1")
    noise = Noise(pair_sd=args.pair_sd, val_pair_sd=args.val_sd)
    scenarios = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    print(space_text(scenarios))
    print(f"noise: {asdict(noise)}\ntuner: {tuner_text(spec)}\n")
    rows, raw = [], {}
    for si, s in enumerate(SCENARIOS):
        if s not in scenarios:
            continue
        t0 = time.monotonic()
        runs = [run_search(s, noise, (args.seed, si, i), spec) for i in range(n)]
        raw[s.name] = runs
        rows.append(summarise(s, runs, spec, seconds_per_step=args.seconds_per_step,
                              seconds_per_job=args.seconds_per_job))
        print(f"[{len(rows)}/{len(scenarios)}] {s.name}: {n} searches in "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(table(rows, seconds_per_step=args.seconds_per_step,
                seconds_per_job=args.seconds_per_job))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": list(argv if argv is not None else sys.argv[1:]),
                       "noise": asdict(noise), "spec": asdict(spec),
                       "seconds_per_step": args.seconds_per_step,
                       "seconds_per_job": args.seconds_per_job, "summary": rows,
                       "searches": raw}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
