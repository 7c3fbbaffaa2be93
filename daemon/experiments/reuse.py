"""Trials a forked experiment takes from earlier ones instead of training them again.

A forked trial is a function of its starting checkpoint, its arm's job config and its repeat:
it resumes the checkpoint's weights, optimizer, sampler position and RNG, with the repeat's own
data order (``forked.py``), and nothing else enters its training. Run again from the same
checkpoint, it trains the same weights on the same batches and ends at the same validation
loss (on this CPU bitwise: ``tests/daemon/test_forked.py`` runs one twice). So when a forked
experiment names earlier ones (``ExperimentSpec.reuse``, the auto-tuner's quality rounds), it
starts from the first one's checkpoint instead of a base job of its own, and an arm with the
same job config as an arm of theirs takes that arm's finished trials, repeat by repeat: the
tuner's best-so-far is trained once per search, not again in every quality round.

What a reused trial does not repeat is its *timing*: its throughput was measured at another
time, so a verdict's speed ratio between a reused trial and a new one mixes the machine of two
moments. A quality round is read for its quality only (its speed comes from the interleaved
round that sent it), and each reused result says where it came from (``reused_from``), which
the experiment's page shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traind.daemon.db import queue

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from sqlalchemy import Engine


def _setting(base_config: Mapping[str, Any], overrides: Mapping[str, Any]) -> str:
    """What a trial trains, as one comparable text: the base job (its name aside: it only
    names the runs) and the arm's overrides."""
    job = {k: v for k, v in base_config.get("job", {}).items() if k != "name"}
    return json.dumps({**base_config, "job": job, "arm": overrides}, sort_keys=True,
                      default=str)


def reusable(engine: Engine, sources: Sequence[int], *, base_config: Mapping[str, Any],
             arms: Sequence[Mapping[str, Any]], repeats: int, experiments_dir: Path,
             ) -> tuple[Path | None, dict[tuple[int, int], dict[str, Any]]]:
    """The starting checkpoint and the finished trials a new forked experiment of
    ``base_config`` and ``arms`` (``{"name", "overrides", ...}``, in position order) takes
    from ``sources`` (earlier forked experiments, first to last): (checkpoint, {(arm index,
    repeat): result}). The checkpoint is the first source's that still exists under
    ``experiments_dir`` (the daemon's own experiment folders: loading one unpickles it); only
    trials that started from it count, an earlier source's before a later one's. A result
    says which trial it came from (``reused_from``: the one that ran, not a copy of it).
    (None, {}) when no source has one: the experiment then makes its own with a base job."""
    found = [(v, [(t, t.result) for t in queue.list_trials(engine, experiment_id=v.id)
                  if t.state == "done" and isinstance(t.result, dict)])
             for i in sources
             if (v := queue.get_experiment(engine, experiment_id=i)) is not None
             and v.mode == "forked"]
    root = experiments_dir.resolve()
    checkpoint = next((path for _, done in found for _, result in done
                       if (path := Path(str(result.get("checkpoint", "")))).is_absolute()
                       and path.exists() and path.resolve().is_relative_to(root)), None)
    if checkpoint is None:
        return None, {}
    wanted = {_setting(base_config, a["overrides"]): i for i, a in enumerate(arms)}
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for v, done in reversed(found):  # written last, an earlier source's trial wins
        by_arm = {a["id"]: _setting(v.base_config, a["overrides"]) for a in v.arms}
        for t, result in done:
            index = wanted.get(by_arm.get(t.arm_id, ""))
            if index is None or t.repeat >= repeats \
                    or result.get("checkpoint") != str(checkpoint):
                continue
            out[(index, t.repeat)] = {**result, "reused_from": result.get("reused_from")
                                      or {"experiment_id": v.id, "trial_id": t.id}}
    return checkpoint, out
