"""Interleaved A/B experiments on this machine, end to end through the node (no web server).

    python bench/ab_demo.py                      # fp32 vs bf16, then none vs int8 vs powersgd
    python bench/ab_demo.py --autotune           # then an auto-tuning search of the same space

Each experiment is one 2-rank DDP job (gloo) whose arms alternate in blocks (ABBA...); the
verdict is the daemon's (daemon/experiments/ab.py: paired ratio with its 95% interval, the
always-valid sequential test, the quality guard). Printed: one row per arm with the ratio, the
interval, the verdict and its reason. A state folder is made under /tmp and left there for
inspection.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from traind.daemon.config import load_settings
from traind.daemon.node import Node
from traind.daemon.service import AutotuneSpec, ExperimentSpec


def _row(arm: str, v: dict[str, Any] | None) -> str:
    if not v:
        return f"  {arm:<10} (baseline)"
    def num(x: Any) -> str:
        return "   -  " if x is None else f"{x:6.3f}"
    return (f"  {arm:<10} ratio {num(v.get('ratio'))} [{num(v.get('low'))}, "
            f"{num(v.get('high'))}]  {v['kind']:<28} {v.get('reason', '')}")


async def _experiment(node: Node, spec: ExperimentSpec) -> None:
    t0 = time.monotonic()
    info = await node.service.submit_experiment(spec)
    print(f"\n== {spec.name}: {' vs '.join(a['name'] for a in spec.arms)} "
          f"({spec.steps} steps, blocks of {spec.block_steps}) ==", flush=True)
    while True:
        found = await asyncio.to_thread(node.experiment, info.id)
        assert found is not None
        if found.state in ("done", "failed", "cancelled"):
            break
        await asyncio.sleep(2)
    print(f"  state {found.state} after {time.monotonic() - t0:.0f} s")
    for i, arm in enumerate(found.arms):
        print(_row(arm, None if i == 0 else (found.verdict or {}).get(arm)))


async def main(args: argparse.Namespace) -> None:
    var = Path(tempfile.mkdtemp(prefix="traind-ab-demo-"))
    node = Node(load_settings(env={}, overrides=[
        "daemon.default_job=false", f"daemon.var_dir={var}", "job.nproc_per_node=2",
        "job.eval_every=100000", "job.checkpoint_every=100000", "telemetry.every=10"]))
    node.migrate()
    print(f"state folder: {var}")
    try:
        await _experiment(node, ExperimentSpec(
            name="precision", steps=args.steps, block_steps=args.block,
            arms=({"name": "fp32", "precision": "fp32"},
                  {"name": "bf16", "precision": "bf16"})))
        await _experiment(node, ExperimentSpec(
            name="compression", steps=args.steps * 3 // 2, block_steps=args.block,
            arms=({"name": "none", "compression": {"method": "none"}},
                  {"name": "int8", "compression": {"method": "int8"}},
                  {"name": "powersgd", "compression": {"method": "powersgd",
                                                       "powersgd_rank": 4}})))
        if args.autotune:
            tune = await node.service.submit_autotune(AutotuneSpec(
                name="demo", precisions=("fp32", "bf16", "fp8"),
                compressions=({"method": "none"}, {"method": "int8"},
                              {"method": "powersgd", "powersgd_rank": 4}),
                steps=args.steps // 2, max_rounds=2, block_steps=args.block))
            await node.tuner.wait(tune.id)
            found = node.service.autotune(tune.id)
            assert found is not None
            print(f"\n== autotune {found.id}: {found.state}; best {found.best} ==")
            for left in found.infeasible:
                print(f"  left out {left['candidate']}: {left['reason']}")
            for r in found.rounds:
                print(f"  {r['stage']} round {r['index'] + 1} ({r['steps']} steps) "
                      f"vs {r['baseline']['precision']}/{r['baseline']['compression']}")
                for name, v in (r["verdicts"] or {}).items():
                    print("  " + _row(name, v))
    finally:
        await node.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800, help="steps of the 2-arm experiment")
    parser.add_argument("--block", type=int, default=20, help="steps per block")
    parser.add_argument("--autotune", action="store_true", help="also run a search")
    asyncio.run(main(parser.parse_args()))
