"""Adaptive precision on the default job against fp32 of the same seed: does it adapt, and what
does it cost in validation loss?

    python bench/adaptive_precision.py                  # 2000 steps, fp32 then adaptive
    python bench/adaptive_precision.py --steps 500 --set precision.snr_high=20

One process each, one after the other (``TrainConfig()`` defaults: the default job). Printed:
each measured group's SNR (``trainer.precision.snr_from_moments``) as quartiles over each
quarter of the run, each group's switches, the share of the run each group spent in the low
precision, and the validation loss of both runs with its difference against
``interleave.loss_margin``. Both runs' events are kept as JSON lines in --out; with --only,
the runs can be made one call at a time and the report comes from the second.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from traind.contracts.events import (
    EvalEvent,
    LifecycleEvent,
    PrecisionEvent,
    SNREvent,
    decode_complete,
)
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import FileSink


def _config(steps: int, mode: str, sets: list[str]) -> TrainConfig:
    tree: dict[str, Any] = {"job": {"steps": steps, "device": "cpu", "checkpoint_every": 10**9},
                            "precision": {"mode": mode}}
    for item in sets:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        tree.setdefault(section, {})[field] = value
    return TrainConfig.model_validate(tree)


def _run(cfg: TrainConfig, out: Path, name: str) -> tuple[list[Any], float, float]:
    """Train, streaming the events to ``out/<name>.jsonl`` (a run stopped early leaves what it
    did); a finished run already there is read back (the two runs can be made one at a time,
    with the same --out)."""
    path = out / f"{name}.jsonl"
    if path.exists():
        events = decode_complete(path.read_bytes())
        final = [e for e in events if isinstance(e, LifecycleEvent) and e.phase == "finished"]
        if final:
            return events, final[-1].detail["val_loss"], final[-1].detail["seconds"]
        path.unlink()  # an unfinished run: again
    sink = FileSink(path)
    t0 = time.perf_counter()
    try:
        result = train(cfg, sink)
    finally:
        sink.close()
    assert result.val_loss is not None
    return decode_complete(path.read_bytes()), result.val_loss, time.perf_counter() - t0


def _quantiles(values: list[float]) -> str:
    if len(values) < 2:
        return "      -      "
    q = statistics.quantiles(values, n=4)
    return f"{q[0]:5.2f} {q[1]:5.2f} {q[2]:5.2f}"


def report(fp32: list[Any], adaptive: list[Any], steps: int, cfg: TrainConfig,
           val: tuple[float, float]) -> None:
    windows = {e.window_step: e for e in adaptive if isinstance(e, SNREvent) and e.rank == 0}
    groups = next(iter(windows.values())).groups if windows else []
    quarters = [(q * steps // 4, (q + 1) * steps // 4) for q in range(4)]
    print("per-group SNR (mean²/var of the gradient norm over each window of "
          f"{cfg.precision.snr_window} steps), quartiles 25/50/75% per quarter of the run")
    print(f"{'group':<8}" + "".join(f"  steps {a + 1:>4}-{b:<4}  " for a, b in quarters))
    for i, g in enumerate(groups):
        cells = [_quantiles([w.snr[i] for s, w in windows.items() if a < s <= b])
                 for a, b in quarters]
        print(f"{g:<8}" + "".join(f"  {c:<17}" for c in cells))
    switches = [e for e in adaptive if isinstance(e, PrecisionEvent) and e.rank == 0]
    print(f"\nswitches (snr_high {cfg.precision.snr_high}, snr_low {cfg.precision.snr_low}, "
          f"min_dwell {cfg.precision.min_dwell}):")
    low = cfg.precision.low
    for g in groups:
        own = [e for e in switches if e.group == g]
        mode, since, in_low = "fp32", 0, 0
        for e in own:
            in_low += (e.step - since) if mode == low else 0
            mode, since = e.after, e.step
        in_low += (steps - since) if mode == low else 0
        moves = ", ".join(f"{e.step}:{e.after}({e.snr:.2f})" for e in own) or "none"
        print(f"  {g:<8} {in_low / steps:6.1%} of steps in {low}; {moves}")
    in_low_at_end = sum(1 for g in groups
                        if ([e.after for e in switches if e.group == g] or ["fp32"])[-1] == low)
    ever = {e.group for e in switches if e.after == low}
    print(f"  groups ever in {low}: {len(ever)}/{len(groups)}; in {low} at the end: "
          f"{in_low_at_end}/{len(groups)}")
    evals = {name: {e.step: e.val_loss for e in events if isinstance(e, EvalEvent)}
             for name, events in (("fp32", fp32), ("adaptive", adaptive))}
    print("\nvalidation loss by step (fp32 | adaptive):")
    for s in sorted(evals["fp32"])[::max(1, len(evals["fp32"]) // 8)]:
        print(f"  {s:>5}  {evals['fp32'][s]:.4f} | {evals['adaptive'].get(s, float('nan')):.4f}")
    diff = val[1] - val[0]
    margin = cfg.interleave.loss_margin
    print(f"final val loss: fp32 {val[0]:.4f}, adaptive {val[1]:.4f}, difference {diff:+.4f} "
          f"({'within' if abs(diff) <= margin else 'OUTSIDE'} the {margin} margin)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=TrainConfig().job.steps)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="an override for the adaptive run (e.g. precision.snr_high=2)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the events")
    ap.add_argument("--only", choices=("fp32", "adaptive"), default=None,
                    help="make one of the two runs now (report with a later call, same --out)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="traind-adaptive-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(args.steps, "adaptive", args.set)
    if args.only != "fp32":
        events, val, t_ad = _run(cfg, out, "adaptive")
    if args.only == "adaptive":
        return
    fp32_events, fp32_val, t_fp32 = _run(_config(args.steps, "fp32", []), out, "fp32")
    if args.only == "fp32":
        return
    print(f"{args.steps} steps: fp32 {t_fp32:.0f} s, adaptive {t_ad:.0f} s (events in {out})\n")
    report(fp32_events, events, args.steps, cfg, (fp32_val, val))


if __name__ == "__main__":
    main()
