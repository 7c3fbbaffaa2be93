"""Evidence an experiment takes from earlier ones of the same comparison instead of measuring
it again: a forked experiment's trials (:func:`reusable`), an interleaved one's pairs
(:func:`carried_pairs`).

**Forked trials.**
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

**Interleaved pairs.** An interleaved verdict is an always-valid sequential test over the
stream of paired log throughput ratios of one arm against one baseline; its error bound holds
at every look, so the stream may go on after an undecided look, in the same job or in a later
one. When an interleaved experiment names earlier ones (``ExperimentSpec.carry``: the
auto-tuner's later speed rounds of a stage, against the same best), each of its arms starts
from the pairs they measured of the same comparison: the same job apart from its budget and
name, the same baseline setting, the same arm setting. A pair is a ratio between two blocks of
one job, moments apart, so the machine of another moment cancels in it as in any pair (what a
forked trial's timing cannot do). Only the pairs each source's verdict counted are taken (its
run may have gone on a few blocks after its last arm was decided), and only its own (a source
names its own sources, which the new experiment names too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traind.daemon.db import crud, queue
from traind.daemon.experiments.ab import interrupted, log_ratios, measured_pairs, own_pairs
from traind.daemon.experiments.evidence import verdict_blocks

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from sqlalchemy import Engine

    from traind.daemon.experiments.ab import Block


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


def _comparison(base_config: Mapping[str, Any]) -> str:
    """What an interleaved experiment's blocks measure, as one comparable text: its job apart
    from the name and the budget, with the block shape (not the arms, nor the verdict's
    settings, which may differ between rounds)."""
    job = {k: v for k, v in base_config.get("job", {}).items() if k not in ("name", "steps")}
    il = base_config.get("interleave", {})
    return json.dumps({**base_config, "job": job, "interleave": {
        k: il.get(k) for k in ("block_steps", "warmup_steps")}}, sort_keys=True, default=str)


def _key(overrides: Mapping[str, Any]) -> str:
    return json.dumps(overrides, sort_keys=True, default=str)


def carried_pairs(engine: Engine, sources: Sequence[int], *, base_config: Mapping[str, Any],
                  arms: Sequence[Mapping[str, Any]]) -> tuple[dict[str, list[float]], list[int]]:
    """The pairs a new interleaved experiment of ``base_config`` and ``arms`` (``{"name",
    "overrides"}``, baseline first) carries from ``sources`` (earlier interleaved experiments,
    first to last): ({arm name: log ratios, oldest first}, the sources that gave any). A
    source counts only when it ended ``done``, or was interrupted by its daemon stopping
    (``ab.interrupted``: its pairs so far are measured all the same), measured the same
    comparison and had the same baseline; an arm takes the pairs of the source's arm with the
    same setting."""
    want, baseline = _comparison(base_config), _key(arms[0]["overrides"])
    ours = {_key(a["overrides"]): str(a["name"]) for a in arms[1:]}
    out: dict[str, list[float]] = {}
    used: list[int] = []
    for i in sources:
        v = queue.get_experiment(engine, experiment_id=i)
        if v is None or v.mode != "interleaved" or v.run_id is None \
                or (v.state != "done" and not interrupted(v.verdict)) \
                or _comparison(v.base_config) != want or _key(v.arms[0]["overrides"]) != baseline:
            continue
        names = [str(a["name"]) for a in v.arms]
        blocks = verdict_blocks(crud.run_events(engine, run_id=v.run_id, kind="arm"))
        took = False
        for a in v.arms[1:]:
            mine = ours.get(_key(a["overrides"]))
            own = counted_pairs(blocks, names, str(a["name"]), (v.verdict or {}).get(a["name"]))
            if mine is None or not own:
                continue
            out.setdefault(mine, []).extend(own)
            took = True
        if took:
            used.append(i)
    return out, used


def counted_pairs(blocks: Sequence[Block], arms: Sequence[str], arm: str,
                  record: Mapping[str, Any] | None) -> list[float]:
    """The log ratios of ``arm``'s own pairs that its verdict ``record`` counted, oldest
    first: ``pairs`` less those it ``carried`` (the run may have gone on after the verdict)."""
    return log_ratios(measured_pairs(blocks, arms, arm))[:max(0, own_pairs(record or {}))]


def carried_from(budget: Mapping[str, Any]) -> tuple[int, ...]:
    """The experiments whose pairs an interleaved experiment's budget says it carries."""
    return tuple(int(i) for i in (budget.get("carried") or {}).get("from") or ())


def carried_of(budget: Mapping[str, Any]) -> dict[str, list[float]]:
    """The pairs an interleaved experiment's budget says it carries, per arm (what the
    interleaved submit stored: ``{"from": [ids], "pairs": {arm: log ratios}}``)."""
    pairs = (budget.get("carried") or {}).get("pairs") or {}
    return {str(arm): [float(x) for x in logs] for arm, logs in pairs.items()}
