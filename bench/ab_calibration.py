"""A/A calibration and power of the interleaved A/B verdict, on real runs (traind issue 14).

    python bench/ab_calibration.py --out /tmp/calib.json      # 20 A/A + 10 planted, ~35 min
    python bench/ab_calibration.py --aa 3 --planted 2 --out /tmp/calib-smoke.json
    python bench/ab_calibration.py --replay /tmp/calib.json   # re-judge saved blocks
    python bench/ab_calibration.py --replay a.json.gz b.json  # ... of several runs, pooled

**Record, then judge.** Each experiment is one real interleaved training job of the node's
default job (``load_settings(env={})``: the shipped defaults, no config file, no TRAIND_*
variables) with two arms of identical settings, ``a`` and ``b`` (fp32, compression none).
In an A/A experiment they are the same; in a planted one arm ``b`` sleeps ``--slowdown`` of
each step's compute time (``interleave.arms.*.slowdown``, inside its blocks' measured
seconds), a known slowdown of about 5%. Changes to the default job, all stated in the JSON's
``settings``: ``job.threads`` 1 (the default's two intra-op threads per rank oversubscribe this
shared machine, issue 14), a seed per experiment (independent weights and data order),
``--steps`` and ``--block-steps``, no checkpoints before the end, and a validation loss at
every block's last step (``job.eval_every`` = block steps: evaluated after the block's last
step was timed, so it is outside the block's seconds; the validation-loss noise per block is
one of the figures the quality guard needs).

Each job runs as ``traind run`` runs one (``daemon.runs.jobs.Job``: torchrun, the worker, events
over the Unix socket), not through the node's experiment runner: the bench must record every
block of the whole budget, whatever the daemon's stopping rule does with a run once it has
decided, so that a later statistics can be replayed on the same blocks; and a fresh process per
experiment keeps one experiment's allocator and threads out of the next. Every ``ArmEvent``
(and the block's validation loss) is saved raw to ``--out`` after each experiment.

The verdicts are computed afterwards by replaying the blocks through
``traind.daemon.experiments.ab.evaluate``, block by block as the daemon sees them arrive
(``finished=False``), then once more with ``finished=True`` at the budget: the steps (and wall
seconds since the launch) to a decision are where the replay first decides. ``--replay FILE``
re-judges saved blocks with whatever the statistics are now; several files are pooled in
launch order.

Printed per group: the verdict kinds; for A/A the false-positive rate (``better`` or
``worse`` between identical arms) with its 95% Clopper-Pearson interval (goal <= 5%), for the
planted group the power (``worse``; goal >= 80%) and the share eliminated (``worse`` or
``no gain``: futility stops first, by design, and either takes the arm out of a search); the
median (IQR) steps and wall seconds to the verdict; and the noise: the sd and robust sd (MAD x
1.4826) of the per-pair log throughput ratios, pooled within experiments, and the sd of the
per-pair differences of block training loss and of validation loss.

Results (``bench/results/``, 2 CPU ranks, ``--steps 480`` for A/A): 24 A/A under load
(``2026-12-05-aa-480``), 24 on a quiet machine (``-aa-480-quiet``) and 24 more with other
seeds (``-aa-480-seed100``, ``--seed-offset 100``, a third of them beside a test suite):
false positives 0/24 each, **0/72 pooled [0, 5.0%]** (``--replay`` all three); per-pair log
ratio robust sd 0.052 under load, **0.019 quiet** (sd 0.023), 0.024 in the third batch.
With the band left to the node, "no difference" in 19/24
under load and **21/24 = 87.5% [67.6, 97.3%] quiet**, at a median 280 steps (the fixed +-2%
band is narrower than a 480-step A/A can reach: 2/24). A planted 5% slowdown, 12 x 1,600
steps quiet (``-planted-1600``): worse 12/12 [73.5, 100%] at a median 280 steps.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scipy import stats as st

from traind.contracts.events import ArmEvent, EvalEvent
from traind.daemon.config import (
    assign,
    corpus_cache_dir,
    load_settings,
    parse_value,
    train_config,
)
from traind.daemon.experiments import bands
from traind.daemon.experiments.ab import Block, evaluate, pairs
from traind.daemon.runs.jobs import Job
from traind.daemon.service import ExperimentInfo
from traind.trainer.config import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

SCHEMA = 1
ARMS = ("a", "b")  # baseline first; b carries the planted slowdown
SPEED_CLAIMS = ("better", "worse")  # a difference in speed declared
RUNNING = "running"  # evaluate's kind before a verdict
GROUPS = {"aa": "A/A (identical arms)", "planted": "planted slowdown of arm b"}
_BLOCK_FIELDS = frozenset(f.name for f in dataclasses.fields(Block))


# -- recording ----------------------------------------------------------------------------------


def interleaved_job(base: dict[str, Any], arms: list[dict[str, Any]], *, block_steps: int,
                    warmup_steps: int, **job: Any) -> TrainConfig:
    """``base`` (a TrainConfig tree) as an interleaved job of ``arms``, with ``job.*``
    changes; never resumed (each record is a fresh job)."""
    tree = json.loads(json.dumps(base))
    tree["job"].update(resume=False, **job)
    tree["interleave"] = {"arms": arms, "block_steps": block_steps,
                          "warmup_steps": warmup_steps}
    return TrainConfig.model_validate(tree)


def experiment_config(base: dict[str, Any], *, steps: int, block_steps: int, warmup_steps: int,
                      seed: int, slowdown: float, threads: int, out_dir: Path) -> TrainConfig:
    """One experiment's job: ``base`` with the stated changes."""
    same = {"precision": "fp32", "compression": {"method": "none"}}
    return interleaved_job(base, [{"name": ARMS[0], **same},
                                  {"name": ARMS[1], **same, "slowdown": slowdown}],
                           block_steps=block_steps, warmup_steps=warmup_steps, steps=steps,
                           seed=seed, threads=threads, out_dir=str(out_dir),
                           eval_every=block_steps, checkpoint_every=10**9)


def base_tree(var: Path, sets: list[str]) -> dict[str, Any]:
    """The node's default job as a plain tree, the corpus cached in ``var`` (shared by every
    experiment), with ``--set`` overrides."""
    cfg = train_config(load_settings(env={}), default_out_dir=var,
                       default_cache_dir=corpus_cache_dir(var))
    tree: dict[str, Any] = cfg.model_dump(mode="json")
    for item in sets:
        key, _, raw = item.partition("=")
        assign(tree, key.strip().split("."), parse_value(raw.strip()), source=f"--set {item}")
    return tree


async def run_job(cfg: TrainConfig) -> tuple[list[ArmEvent], dict[int, float], float, float]:
    arm_events: list[ArmEvent] = []
    val: dict[int, float] = {}

    def on_event(event: Any) -> None:
        if isinstance(event, ArmEvent) and event.rank == 0:
            arm_events.append(event)
        elif isinstance(event, EvalEvent) and event.rank == 0:
            val[event.step] = event.val_loss

    assert cfg.job.out_dir is not None
    job = Job(cfg, cfg.job.out_dir, on_event)
    launched = time.time()
    await job.start()
    exit_ = await job.wait()
    if exit_.code != 0:
        raise RuntimeError(f"the job failed: {exit_.describe()}\n"
                           + job.log_path.read_text()[-3000:])
    return arm_events, val, launched, time.time()


def record(cfg: TrainConfig, *, group: str, index: int) -> dict[str, Any]:
    """Run one experiment; its raw record (every block, as the worker sent it)."""
    arm_events, val, launched, ended = asyncio.run(run_job(cfg))
    blocks = [{"arm": e.arm, "block": e.block, "step": e.step, "steps": e.steps,
               "tokens": e.tokens, "seconds": e.seconds, "loss": _num(e.loss),
               "grad_error": _num(e.grad_error), "time": e.time,
               "val_loss": _num(val.get(e.step, math.nan))} for e in arm_events]
    iv = cfg.interleave
    return {"group": group, "index": index, "seed": cfg.job.seed,
            "arms": [a.name for a in iv.arms], "slowdown": iv.arms[1].slowdown,
            "steps": cfg.job.steps, "block_steps": iv.block_steps,
            "warmup_steps": iv.warmup_steps, "loss_margin": iv.loss_margin,
            "completed": True, "launched": launched, "ended": ended, "blocks": blocks}


def schedule(n_aa: int, n_planted: int) -> list[str]:
    """The groups in a mixed order (evenly spread), so the machine's drift over the hour
    falls on both groups alike."""
    slots = [((i + 0.5) / n_aa, "aa") for i in range(n_aa)]
    slots += [((i + 0.5) / n_planted, "planted") for i in range(n_planted)]
    return [g for _, g in sorted(slots)]


def save(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a long run is saved after every experiment)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any]:
    """A saved record; gzipped where the name ends .gz (bench/results/ keeps them so)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    data: dict[str, Any] = json.loads(raw)
    if data.get("schema") != SCHEMA:
        raise SystemExit(f"{path}: schema {data.get('schema')!r}, this bench reads {SCHEMA}")
    return data


def pooled(paths: Sequence[Path]) -> dict[str, Any]:
    """Several saved runs as one: their experiments in launch order (the node's band for each
    is chosen from those launched before it), each file's settings kept."""
    runs = [load(p) for p in paths]
    exps = sorted((e for d in runs for e in d["experiments"]), key=lambda e: e["launched"])
    return {**runs[0], "experiments": exps,
            "pooled": [{"file": str(p), "settings": d["settings"]}
                       for p, d in zip(paths, runs, strict=True)]}


def _num(x: float) -> float | None:
    """JSON has no NaN: a missing figure is null."""
    return x if math.isfinite(x) else None


# -- judging (pure) -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Replay:
    kind: str  # the verdict's kind (RUNNING: the record ended before any verdict)
    early: bool  # decided before the budget was spent
    step: int  # the step the verdict came at (the deciding block's last step, or the budget)
    seconds: float  # wall seconds from the launch to that block
    blocks: int
    verdict: dict[str, Any]


def to_block(rec: dict[str, Any]) -> Block:
    """A saved block as the statistics' ``Block``: only the fields it has (a later Block may
    read more of what was saved, e.g. val_loss); null (NaN in the worker) back to NaN."""
    fields: dict[str, Any] = {k: (math.nan if v is None else v) for k, v in rec.items()
                              if k in _BLOCK_FIELDS}
    return Block(**fields)


def replay(exp: dict[str, Any], equivalence: float | None = None,
           min_effect: float | None = None) -> Replay:
    """The verdict the daemon would have reached on ``exp``'s blocks, and where.

    Blocks are fed one at a time (``finished=False``: the sequential test may stop), then the
    whole record once more with ``finished=True`` if the job ran its budget. Only
    ``loss_margin`` (and ``equivalence``, ``min_effect`` when given) is passed, so evaluate's
    other keyword arguments keep their defaults."""
    blocks = [to_block(b) for b in exp["blocks"]]
    arms, arm = list(exp["arms"]), exp["arms"][1]
    band: dict[str, float] = {} if equivalence is None else {"equivalence": equivalence}
    if min_effect is not None:
        band["min_effect"] = min_effect

    def judge(k: int, finished: bool) -> dict[str, Any]:
        try:
            out = evaluate(blocks[:k], arms, finished=finished, loss_margin=exp["loss_margin"],
                           **band)
            return dict(out[arm])
        except ValueError as exc:  # as the daemon's judge() reports it
            return {"kind": "failed (error)", "reason": str(exc)}

    for k in range(1, len(blocks) + 1):
        v = judge(k, finished=False)
        if v["kind"] != RUNNING:  # the sequential test stopped here
            last = exp["blocks"][k - 1]
            return Replay(kind=v["kind"], early=k < len(blocks) or not exp["completed"],
                          step=last["step"], seconds=last["time"] - exp["launched"],
                          blocks=k, verdict=v)
    v = judge(len(blocks), finished=exp["completed"])
    return Replay(kind=v["kind"], early=False, step=exp["steps"],
                  seconds=exp["ended"] - exp["launched"], blocks=len(blocks), verdict=v)


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion k/n: conservative, which
    suits a claim like "the false-positive rate is at most 5%"."""
    if not 0 <= k <= n or n == 0:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    a = (1 - confidence) / 2
    low = 0.0 if k == 0 else float(st.beta.ppf(a, k, n - k + 1))
    high = 1.0 if k == n else float(st.beta.ppf(1 - a, k + 1, n - k))
    return low, high


def pooled_sd(groups: list[list[float]]) -> tuple[float, float, int]:
    """(sd, robust sd, n) of values pooled over groups, each centred on its own mean (sd,
    ddof one per group) or median (MAD x 1.4826): an experiment's own effect (a planted
    slowdown) is not noise."""
    groups = [g for g in groups if len(g) >= 2]
    n = sum(len(g) for g in groups)
    if n - len(groups) < 1:
        return math.nan, math.nan, n
    ss = sum((x - statistics.fmean(g)) ** 2 for g in groups for x in g)
    dev = [abs(x - statistics.median(g)) for g in groups for x in g]
    return math.sqrt(ss / (n - len(groups))), 1.4826 * statistics.median(dev), n


def pair_figures(exp: dict[str, Any]) -> dict[str, list[float]]:
    """Per complete round: log(tokens/s of b / of a), and b - a of block loss and of the
    validation loss after the block."""
    blocks = [to_block(b) for b in exp["blocks"]]
    val = {b["block"]: b.get("val_loss") for b in exp["blocks"]}
    out: dict[str, list[float]] = {"log_ratio": [], "loss": [], "val_loss": []}
    for a, b in pairs(blocks, exp["arms"], exp["arms"][1]):
        if a.throughput > 0 and b.throughput > 0:
            out["log_ratio"].append(math.log(b.throughput / a.throughput))
        if math.isfinite(a.loss) and math.isfinite(b.loss):
            out["loss"].append(b.loss - a.loss)
        if val[a.block] is not None and val[b.block] is not None:
            out["val_loss"].append(val[b.block] - val[a.block])
    return out


def _iqr(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"median {xs[0]:.0f}" if xs else "-"
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return f"median {statistics.median(xs):.0f} [IQR {q[0]:.0f}-{q[2]:.0f}]"


def _rate(k: int, n: int) -> str:
    low, high = clopper_pearson(k, n)
    return f"{k}/{n} = {k / n:.1%}  [95% CI {low:.1%}, {high:.1%}]"


def summarize(group: str, exps: list[dict[str, Any]], replays: list[Replay]) -> list[str]:
    """The group's table, as lines."""
    n = len(exps)
    kinds = Counter(r.kind for r in replays)
    e0 = exps[0]
    lines = [f"== {GROUPS.get(group, group)}: {n} experiments, {e0['steps']} steps each, "
             f"blocks of {e0['block_steps']} ({e0['warmup_steps']} warm-up)"
             + (f", arm b slowdown {e0['slowdown']:.0%}" if group == "planted" else "") + " ==",
             "  verdicts          " + ", ".join(f"{k} {c}" for k, c in kinds.most_common())]
    if group == "aa":
        fp = sum(kinds[k] for k in SPEED_CLAIMS)
        lines.append(f"  false positives   {_rate(fp, n)}   (better/worse; goal <= 5%)")
        rejected = sum(c for k, c in kinds.items() if k.startswith("rejected"))
        lines.append(f"  quality rejected  {_rate(rejected, n)}")
    else:
        lines.append(f"  power (worse)     {_rate(kinds['worse'], n)}   (goal >= 80%)")
        # What a search needs of a slower arm: that it leaves. Futility ("no gain": it cannot
        # be min_effect faster) stops before "worse" is shown, by design.
        out = kinds["worse"] + kinds["no gain"]
        lines.append(f"  eliminated        {_rate(out, n)}   (worse or no gain)")
        lines.append(f"  wrong way         {_rate(kinds['better'], n)}   (better)")
    lines.append(f"  steps to verdict  {_iqr([r.step for r in replays])}; decided before the "
                 f"budget {sum(r.early for r in replays)}/{n}")
    decided = [r.step for r in replays if r.kind in SPEED_CLAIMS]
    if decided:
        lines.append(f"  steps to better/worse  {_iqr([float(s) for s in decided])} "
                     f"({len(decided)} experiments)")
    lines.append(f"  wall s to verdict {_iqr([r.seconds for r in replays])} "
                 "(from the launch: start-up included)")
    figs = [pair_figures(e) for e in exps]
    sd, rsd, m = pooled_sd([f["log_ratio"] for f in figs])
    ratios = [math.exp(statistics.fmean(f["log_ratio"])) for f in figs if f["log_ratio"]]
    lines.append(f"  per-pair log ratio  sd {sd:.4f}, robust sd {rsd:.4f} ({m} pairs, pooled "
                 f"within experiments); ratio b/a per experiment median "
                 f"{statistics.median(ratios) if ratios else math.nan:.3f}")
    for key, name in (("loss", "block train loss"), ("val_loss", "validation loss")):
        # Within a pair the loss curve's slope over one block is in the difference too (its
        # sign alternates with the ABBA order; the first pair's is most of a nat): the
        # second half of each experiment's pairs, where the curve is flat and the quality
        # guard's evidence accrues, is the noise per block worth quoting.
        sd, rsd, m = pooled_sd([f[key] for f in figs])
        late = [f[key][len(f[key]) // 2:] for f in figs]
        lsd, lrsd, lm = pooled_sd(late)
        flat = [x for v in late for x in v]
        mean = statistics.fmean(flat) if flat else math.nan
        lines.append(f"  {name + ' b-a':<20} all {m} pairs: sd {sd:.4f} (robust {rsd:.4f}); "
                     f"second half, {lm} pairs: sd {lsd:.4f} (robust {lrsd:.4f}), mean "
                     f"{mean:+.4f} nats per pair")
    return lines


def auto_bands(exps: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """Each experiment's band as the node would have chosen it at its submission, had the
    band been left to it (``daemon/experiments/bands.py``): from the noise of the experiments
    recorded before it (their replayed verdicts, newest first), at its own budget."""
    out: list[tuple[float, str]] = []
    earlier: list[ExperimentInfo] = []
    for i, exp in enumerate(exps):
        noise = bands.node_noise(earlier)
        pairs = bands.budget_pairs(exp["steps"], exp["block_steps"], len(exp["arms"]))
        band, record = bands.auto_band(noise, pairs)
        out.append((band, record["rule"]))
        v = replay(exp).verdict  # what the node's row would say of it
        earlier.insert(0, ExperimentInfo(
            id=i, name=str(i), state="done", mode="interleaved", arms=tuple(exp["arms"]),
            run_id=None, verdict={exp["arms"][1]: v}, config_hash="", versions={},
            created_at=datetime.fromtimestamp(exp["launched"], UTC), finished_at=None))
    return out


def summarize_auto(exps: list[dict[str, Any]]) -> list[str]:
    """A/A with the band left to the node: how often "no difference" is reached in budget."""
    chosen = auto_bands(exps)
    replays = [replay(e, band) for e, (band, _) in zip(exps, chosen, strict=True)]
    kinds = Counter(r.kind for r in replays)
    widths = sorted({round(b * 100, 1) for b, _ in chosen})
    return [f"== A/A with the band left to the node (auto: from the noise the experiments "
            f"before each measured, at its budget): bands {', '.join(f'+-{w:g}%' for w in widths)}"
            " ==",
            f"  first: {chosen[0][1]}",
            f"  last:  {chosen[-1][1]}",
            "  verdicts          " + ", ".join(f"{k} {c}" for k, c in kinds.most_common()),
            f"  no difference     {_rate(kinds['no difference'], len(exps))}   (goal: reached "
            "within the budget)",
            f"  ended early       {_rate(sum(r.early for r in replays), len(exps))}   "
            "(no difference or no gain before the budget)",
            f"  false positives   {_rate(sum(kinds[k] for k in SPEED_CLAIMS), len(exps))}",
            f"  steps to verdict  {_iqr([r.step for r in replays])}"]


def report(data: dict[str, Any], min_effect: float | None = None) -> str:
    """The tables; ``min_effect``: the futility rule's smallest effect worth having, for the
    replay (None: the daemon's default; 0 turns futility off, so a slower arm runs on until
    "worse" or its budget: the power of the plain two-sided sequential test)."""
    exps = data["experiments"]
    out = []
    if min_effect is not None:
        out += [f"(replayed with min_effect {min_effect:g})", ""]
    for group in GROUPS:
        mine = [e for e in exps if e["group"] == group]
        if mine:
            out += [*summarize(group, mine, [replay(e, min_effect=min_effect) for e in mine]),
                    ""]
    if aa := [e for e in exps if e["group"] == "aa"]:
        out += [*summarize_auto(aa), ""]
    if exps:
        wall = [e["ended"] - e["launched"] for e in exps]
        out.append(f"wall seconds per experiment: {_iqr(wall)}; {sum(wall) / 60:.1f} min in all")
    return "\n".join(out)


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aa", type=int, default=20, help="A/A experiments")
    p.add_argument("--planted", type=int, default=10, help="experiments with a slowed arm b")
    p.add_argument("--slowdown", type=float, default=0.05, help="arm b's planted slowdown")
    p.add_argument("--steps", type=int, default=480, help="budget per experiment (steps)")
    p.add_argument("--block-steps", type=int, default=20, help="steps per block")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of a block")
    p.add_argument("--threads", type=int, default=1, help="job.threads")
    p.add_argument("--seed-offset", type=int, default=0,
                   help="experiment i runs with seed i + this (a later batch to pool with "
                        "--replay: other weights and data orders than an earlier one's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a further change to the default job (as traind run --set)")
    p.add_argument("--out", type=Path, default=Path("ab_calibration.json"),
                   help="the raw blocks (saved after every experiment)")
    p.add_argument("--replay", type=Path, nargs="+", metavar="FILE",
                   help="re-judge these files' blocks, pooled; run nothing")
    p.add_argument("--min-effect", type=float, help="replay with this futility threshold "
                   "(0: none, the two-sided test's power); default: the daemon's")
    args = p.parse_args()
    if args.replay:
        print(report(pooled(args.replay), args.min_effect))
        return
    if args.aa < 0 or args.planted < 0 or args.aa + args.planted == 0:
        p.error("--aa/--planted: at least one experiment")

    var = Path(tempfile.mkdtemp(prefix="traind-calib-"))
    base = base_tree(var, args.set)
    data: dict[str, Any] = {"schema": SCHEMA, "created": time.time(), "settings": {
        "argv": sys.argv[1:], "threads": args.threads, "steps": args.steps,
        "block_steps": args.block_steps, "warmup_steps": args.warmup_steps,
        "slowdown": args.slowdown, "set": args.set, "model": base["model"],
        "seed_offset": args.seed_offset,
        "batch_size": base["job"]["batch_size"], "ranks": base["job"]["nproc_per_node"],
        "cpus": os.cpu_count(), "load_before": os.getloadavg()}, "experiments": []}
    order = schedule(args.aa, args.planted)
    counts: Counter[str] = Counter()
    try:
        for i, group in enumerate(order):
            counts[group] += 1
            out_dir = var / "runs" / str(i)
            cfg = experiment_config(base, steps=args.steps, block_steps=args.block_steps,
                                    warmup_steps=args.warmup_steps,
                                    seed=i + args.seed_offset,
                                    slowdown=args.slowdown if group == "planted" else 0.0,
                                    threads=args.threads, out_dir=out_dir)
            exp = record(cfg, group=group, index=counts[group] - 1)
            shutil.rmtree(out_dir, ignore_errors=True)  # its checkpoint: not needed
            data["experiments"].append(exp)
            save(args.out, data)
            r = replay(exp)
            print(f"[{i + 1:>2}/{len(order)}] {group:<7} seed {cfg.job.seed:<3} "
                  f"{exp['ended'] - exp['launched']:5.0f} s, {len(exp['blocks'])} blocks: "
                  f"{r.kind} at step {r.step} (ratio {r.verdict.get('ratio') or math.nan:.3f})",
                  flush=True)
    finally:
        shutil.rmtree(var, ignore_errors=True)
    print(f"\nraw blocks: {args.out}\n")
    print(report(data))


if __name__ == "__main__":
    main()
