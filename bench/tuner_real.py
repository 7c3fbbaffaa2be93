"""The auto-tuner on the real trainer (traind issue 14): one search, then the truth it is judged by.

    python bench/tuner_real.py                      # d_model 256, 2 ranks: ~15-25 min here
    python bench/tuner_real.py --d-model 512 --steps 400 --reference-steps 2400

**The search** is the node's own: a ``Node`` on SQLite in a temporary folder (no web server,
no default job) takes an ``AutotuneSpec`` through ``service.submit_autotune`` and runs every
round as the daemon does (interleaved speed rounds, forked quality rounds, one experiment job
at a time), on the space fp32 / bf16 x compression none / int8 / powersgd (rank 4), 2 gloo
ranks of one thread each, the node's default job at ``--d-model`` (4 layers, seq 128, batch 8:
a size where bf16's AMX matmuls win here). The search's budgets are scaled to a bench:
``--steps`` per two arms in blocks of ``--block-steps`` (``--warmup-steps`` left out),
quality rounds of ``--quality-steps`` x 4 repeats.

**The truth** is measured after it, apart from the search: one interleaved job with all six
arms in blocks (A B C D E F | F E D C B A | ...), run to its whole ``--reference-steps``
budget (recorded raw as ``bench/ab_calibration.py`` records, no sequential stop), each arm's
ratio to fp32.none read at the end by ``ab.evaluate`` (its always-valid interval) and the
fixed-horizon mean of the pairs. The **true best** is the fastest arm by that ratio; the
search **found** it when its choice is that arm or within ``min_effect`` (2%) of it (a gain
the tuner is told is not worth a change). **Regret** = the best's ratio / the choice's - 1.
Quality is not re-measured for the truth: none of these arms is known to harm (top-k without
error feedback, the harmful one, is left out of this space; its test is
``tests/daemon/test_forked.py::test_a_known_harmful_arm_is_rejected_on_its_own_weights``).

**The budget** beside it: the search's steps (each interleaved round to the step its last arm
was decided at; each forked round's trials x steps + its base job) against the exhaustive
equal-allocation schedule of ``bench/tuner.py`` (``exhaustive_steps``: every challenger in an
A/B of its own, per arm the steps of the search's largest speed round, and a quality round
each). **Time per decision**: the search's wall seconds over its arm verdicts, and the
decisions per week one node makes at that rate.

Result (the defaults, 2026-12-05, while bench/ab_calibration.py's A/A runs shared the two
cores): the search ran 4 rounds, 930 steps in 624 s (precision: bf16 better at 120 steps of
200, then its forked quality round; compression at bf16: int8 worse, powersgd inconclusive and
pruned; joint: fp32 + int8 and fp32 + powersgd worse), and chose bf16.none. The reference
(1,200 steps): bf16.none 1.428 [1.381, 1.476], bf16.powersgd 1.295, fp32.none 1, fp32.powersgd
0.918, bf16.int8 0.883, fp32.int8 0.704: the true best, regret 0%. Budget 930 against the
exhaustive 2,650 (0.35); 104 s per arm verdict, ~970 searches per week.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ab_calibration import interleaved_job, run_job  # bench/ is on sys.path as a script
from tuner import WEEK_S, exhaustive_steps

from traind.daemon.autotune import search
from traind.daemon.autotune.search import Candidate, Hardware, Space
from traind.daemon.config import corpus_cache_dir, load_settings, train_config
from traind.daemon.experiments import ab, forked
from traind.daemon.node import Node
from traind.daemon.service import AutotuneSpec

if TYPE_CHECKING:
    from traind.trainer.config import TrainConfig

COMPRESSIONS = ({"method": "none"}, {"method": "int8"},
                {"method": "powersgd", "powersgd_rank": 4})
SPACE = Space(precisions=("fp32", "bf16"), compressions=COMPRESSIONS)
BASE = Candidate("fp32", {"method": "none"})
RANKS = 2


def job_overrides(d_model: int) -> list[str]:
    """The node's default job at this width, one thread per rank, no checkpoints but the
    forked trials' own, a small validation set (the quality rounds read it)."""
    return [f"model.d_model={d_model}", "model.n_layers=4", "model.n_heads=4",
            "model.seq_len=128", "job.batch_size=8", "job.threads=1",
            "job.eval_every=100000", "job.eval_batches=4", "job.checkpoint_every=100000"]


def arms() -> list[Candidate]:
    ok, _ = search.candidates(SPACE, Hardware(device="cpu", ranks=RANKS, strategy="ddp"))
    return [BASE, *(c for c in ok if c.name != BASE.name)]


# -- the search -------------------------------------------------------------------------------


def round_steps_used(rnd: dict[str, Any], info: Any) -> int:
    """The steps a finished round's experiment ran: an interleaved one to the step its last
    arm was decided at (the node stops it there), a forked one the trials it ran (not those
    it took from an earlier round: ``reused_trials``) and its base job, if it made one."""
    if rnd["phase"] == "speed" and not search.runs_forked(rnd["stage"], rnd["phase"]):
        verdict = info.verdict or {}
        return max((int(v.get("decided_at_step") or v.get("budget_steps") or rnd["steps"])
                    for v in verdict.values()), default=rnd["steps"])
    base = 0 if rnd.get("reuse") else forked.MIN_BASE_STEPS  # reuse: an earlier checkpoint
    return (len(info.trial_runs) - info.reused_trials) * rnd["steps"] + base


async def tune(node: Node, spec: AutotuneSpec) -> tuple[Any, float]:
    started = time.time()
    info = await node.service.submit_autotune(spec)
    await node.tuner.wait(info.id)
    found = node.service.autotune(info.id)
    return found, time.time() - started


# -- the truth --------------------------------------------------------------------------------


def reference(cfg: TrainConfig, names: list[str], *, loss_margin: float) -> dict[str, Any]:
    """Each arm's ratio to the first over the whole budget of the interleaved job ``cfg``."""
    events, _, launched, ended = asyncio.run(run_job(cfg))
    blocks = [ab.Block(e.arm, e.block, e.tokens, e.seconds, e.loss, e.grad_error)
              for e in events]
    verdict = ab.evaluate(blocks, names, finished=True, loss_margin=loss_margin)
    out: dict[str, Any] = {names[0]: {"ratio": 1.0, "low": 1.0, "high": 1.0, "mean": 1.0}}
    for arm in names[1:]:
        logs = [math.log(b.throughput / a.throughput) for a, b in ab.pairs(blocks, names, arm)
                if a.throughput > 0 and b.throughput > 0]
        v = verdict[arm]
        out[arm] = {"ratio": v.get("ratio"), "low": v.get("low"), "high": v.get("high"),
                    "kind": v.get("kind"), "pairs": len(logs),
                    "mean": math.exp(statistics.fmean(logs)) if logs else None}
    return {"arms": out, "seconds": ended - launched, "blocks": len(blocks)}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="a first speed round's steps per "
                   "two arms")
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--quality-steps", type=int, default=40)
    p.add_argument("--quality-repeats", type=int, default=4)
    p.add_argument("--reference-steps", type=int, default=1200,
                   help="the six-arm reference job's budget")
    p.add_argument("--json", type=Path, help="save the result here")
    args = p.parse_args()

    var = Path(tempfile.mkdtemp(prefix="traind-tuner-real-"))
    overrides = [*job_overrides(args.d_model), "daemon.default_job=false",
                 f"daemon.var_dir={var}"]
    settings = load_settings(env={}, overrides=overrides)
    spec = AutotuneSpec(name="bench", precisions=SPACE.precisions, compressions=COMPRESSIONS,
                        steps=args.steps, block_steps=args.block_steps,
                        warmup_steps=args.warmup_steps, quality_steps=args.quality_steps,
                        quality_repeats=args.quality_repeats,
                        overrides={"job.nproc_per_node": RANKS})
    try:
        node = Node(settings)
        node.migrate()

        candidates = arms()
        names = [c.name for c in candidates]

        async def search_then_stop() -> tuple[Any, float]:
            try:
                return await tune(node, spec)
            finally:
                await node.shutdown()

        print(f"searching: {', '.join(names)} on {RANKS} ranks, d_model "
              f"{args.d_model} ...", flush=True)
        found, wall = asyncio.run(search_then_stop())
        if found is None or found.state != "done":
            raise SystemExit(f"the search did not finish: {found}")
        rounds = []
        for r in found.rounds:
            info = node.service.experiment(r["experiment_id"])
            used = round_steps_used(r, info)
            rounds.append({**r, "used": used})
            kinds = {k: v.get("kind") for k, v in (r["verdicts"] or {}).items()}
            print(f"  {r['stage']:<11} {r['phase']:<7} {r['steps']:>5} steps (ran {used:>5}): "
                  + ", ".join(f"{k} {v}" for k, v in kinds.items()), flush=True)
        chosen = str(found.best["name"])
        steps = sum(r["used"] for r in rounds)
        verdicts = sum(len(r["challengers"]) for r in rounds)
        plan = search.Plan(best=BASE, feasible=tuple(candidates), steps=spec.steps,
                           rounds=tuple(search.Round.from_dict(r) for r in found.rounds),
                           quality_steps=spec.quality_steps)
        exhaustive = exhaustive_steps(plan, len(candidates), repeats=spec.quality_repeats)

        print(f"chosen {chosen} after {steps} steps in {wall:.0f} s; measuring the truth "
              f"({args.reference_steps} steps, all {len(names)} arms) ...", flush=True)
        base = train_config(settings, default_out_dir=var,
                            default_cache_dir=corpus_cache_dir(var)).model_dump(mode="json")
        job = interleaved_job(base, [c.arm() for c in candidates],
                              block_steps=args.block_steps, warmup_steps=args.warmup_steps,
                              steps=args.reference_steps, nproc_per_node=RANKS,
                              out_dir=str(var / "reference"))
        truth = reference(job, names, loss_margin=spec.loss_margin)
    finally:
        shutil.rmtree(var, ignore_errors=True)

    ratios = {k: float(v["ratio"] if v["ratio"] is not None else v["mean"] or 0.0)
              for k, v in truth["arms"].items()}
    best = max(ratios, key=lambda k: ratios[k])
    regret = ratios[best] / ratios[chosen] - 1
    found_best = chosen == best or regret <= spec.min_effect
    per_verdict = wall / max(1, verdicts)
    print("\ntruth (each arm's ratio to fp32.none over the reference job, always-valid "
          "interval; fixed-horizon mean of the pairs):")
    for k, v in sorted(truth["arms"].items(), key=lambda kv: -ratios[kv[0]]):
        mark = " <- chosen" if k == chosen else ""
        print(f"  {k:<22} {_f(v['ratio'])} [{_f(v['low'])}, {_f(v['high'])}]  mean "
              f"{_f(v['mean'])}{mark}")
    print(f"\ntrue best {best} ({ratios[best]:.3f}x); chosen {chosen} ({ratios[chosen]:.3f}x): "
          f"regret {regret:.1%}; found {'yes' if found_best else 'NO'}")
    print(f"search: {steps} steps (exhaustive {exhaustive}, ratio {steps / exhaustive:.2f}), "
          f"{wall:.0f} s wall, {len(rounds)} rounds, {verdicts} arm verdicts: "
          f"{per_verdict:.0f} s per verdict, {WEEK_S / per_verdict:.0f} verdicts and "
          f"{WEEK_S / wall:.0f} searches per week on this node")
    if args.json:
        args.json.write_text(json.dumps({
            "args": vars(args) | {"json": str(args.json)}, "chosen": chosen, "best": best,
            "regret": regret, "found": found_best, "steps": steps, "exhaustive": exhaustive,
            "wall": wall, "verdicts": verdicts, "rounds": rounds, "truth": truth},
            indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
