"""Experiment jobs on one node, played by a scripted stand-in for torchrun's workers: one at a
time across modes (the node's slots), and interleaved runs stopped once they are decided.

``PacedJob`` is ``test_scale.ScriptedJob`` grown to what these runners read: block events for an
interleaved job (each arm at its scripted speed, with seeded noise), step and eval reports for
a forked trial, a checkpoint at the end (forked base jobs and trials start from one), and a
stop that ends it at the next step. Each job's start and end go into ``PacedJob.log``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from tests.daemon.test_forked import _node
from traind.contracts.events import ArmEvent, EvalEvent, LifecycleEvent, StepEvent
from traind.daemon.db import crud, queue
from traind.daemon.experiments.stats import robust_log_ratios
from traind.daemon.runs.checkpoints import step_of
from traind.daemon.runs.jobs import JobExit
from traind.daemon.service import ExperimentSpec
from traind.trainer.checkpoint import latest, save_checkpoint
from traind.trainer.interleave import arm_index

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from traind.contracts.events import Event
    from traind.daemon.node import Node

TOKENS = 64  # per step
STEP_SECONDS = 0.01  # of the scripted clock


class PacedJob:
    speed: ClassVar[dict[str, float]] = {}  # arm name -> its speed (1.0 when not named)
    noise = 0.02  # relative sd of a block's time
    log: ClassVar[list[tuple[str, float, float, int]]] = []  # (name, start, end, last step)
    orders: ClassVar[dict[str, int]] = {}  # job name -> its data.order

    def __init__(self, cfg: Any, out_dir: Path, on_event: Callable[[Event], None],
                 **_: Any) -> None:
        self.cfg, self.out_dir, self._on_event = cfg, out_dir, on_event
        self.orders[cfg.job.name] = cfg.data.order
        self.pid, self.bad_events = 0, 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[JobExit] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._play())

    async def _play(self) -> JobExit:
        began, job = time.monotonic(), self.cfg.job
        found = latest(self.out_dir) if job.resume else None
        step = step_of(found) if found is not None else 0
        emit = self._on_event
        emit(LifecycleEvent(rank=0, phase="started", step=step, detail={"world_size": 1}))
        if found is not None:
            emit(LifecycleEvent(rank=0, phase="resumed", step=step))
        arms = [a.name for a in self.cfg.interleave.arms]
        block_steps = self.cfg.interleave.block_steps
        rng, clock, block = random.Random(job.seed), 100.0, 0
        while step < job.steps and not self._stop.is_set():
            if arms:  # an interleaved job: one block of one arm
                arm = arms[arm_index(block, len(arms))]
                n = min(block_steps, job.steps - step)
                seconds = n * STEP_SECONDS / self.speed.get(arm, 1.0) * (
                    1 + rng.gauss(0, self.noise))
                step, clock = step + n, clock + seconds
                emit(StepEvent(rank=0, step=step, loss=2.0, lr=1e-3, grad_norm=1.0,
                               tokens=TOKENS, step_seconds=seconds / n, data_seconds=0.0,
                               forward_seconds=0.0, backward_seconds=0.0,
                               optimizer_seconds=0.0, steps=n, time=clock))
                if n == block_steps:
                    emit(ArmEvent(rank=0, step=step, arm=arm, block=block, steps=n,
                                  tokens=TOKENS * n, seconds=seconds, loss=2.0))
                block += 1
            else:  # a forked base job or trial: a step report each step
                step, clock = step + 1, clock + STEP_SECONDS
                emit(StepEvent(rank=0, step=step, loss=2.0, lr=1e-3, grad_norm=1.0,
                               tokens=TOKENS, step_seconds=STEP_SECONDS, data_seconds=0.0,
                               forward_seconds=0.0, backward_seconds=0.0,
                               optimizer_seconds=0.0, time=clock))
            await asyncio.sleep(0.002)
        emit(EvalEvent(rank=0, step=step, val_loss=2.0, batches=1))
        save_checkpoint(self.out_dir, step, {"step": step}, keep_last=2)
        emit(LifecycleEvent(rank=0, phase="finished", step=step))
        self.log.append((job.name, began, time.monotonic(), step))
        return JobExit(code=0, stopped=self._stop.is_set(), log_tail="")

    async def wait(self) -> JobExit:
        assert self._task is not None
        return await self._task

    async def stop(self) -> None:
        self._stop.set()

    def worker_pids(self) -> list[int]:
        return []


@pytest.fixture
def paced(tmp_path: Path) -> Node:
    PacedJob.log, PacedJob.speed, PacedJob.orders = [], {}, {}
    node = _node(tmp_path)
    node.supervisor.job_factory = PacedJob
    return node


def _interleaved(name: str, steps: int, *arms: str, **kw: Any) -> ExperimentSpec:
    return ExperimentSpec(**{"name": name, "steps": steps, "block_steps": 5, "warmup_steps": 1,
                             "arms": tuple({"name": a} for a in arms), **kw})


async def _until_ended(node: Node, *ids: int, timeout: float = 60) -> None:
    for i in ids:
        await asyncio.wait_for(node.experiment_service.wait_ended(i), timeout)
    if pending := node.supervisor.tasks | node.interleaved.tasks:
        await asyncio.wait(pending, timeout=10)


def test_interleaved_and_forked_experiment_jobs_take_turns(paced: Node) -> None:
    node = paced

    async def main() -> tuple[int, int, int, str]:
        first = await node.service.submit_experiment(_interleaved("il-1", 100, "a", "b"))
        forked = await node.service.submit_experiment(ExperimentSpec(
            name="fork", mode="forked", steps=10, repeats=2, block_steps=5,
            arms=({"name": "a"}, {"name": "b"})))
        assert first.state == "running"
        # Once a forked job holds the slot, a new interleaved experiment waits its turn.
        while not any(name.startswith("fork") for name in
                      (r.name for r in node.service.runs() if r.state == "running")):
            await asyncio.sleep(0.005)
        later = await node.service.submit_experiment(_interleaved("il-2", 40, "a", "b"))
        state = later.state
        await _until_ended(node, first.id, forked.id, later.id)
        return first.id, forked.id, later.id, state

    ids = asyncio.run(main())
    assert ids[3] == "queued"
    ended = [node.service.experiment(i) for i in ids[:3]]
    assert [e.state for e in ended if e is not None] == ["done"] * 3, ended
    # Seven jobs (an interleaved one, the forked base job and four trials, the second
    # interleaved one), never two at once.
    jobs = sorted(PacedJob.log, key=lambda j: j[1])
    assert len(jobs) == 7, jobs
    for before, after in itertools.pairwise(jobs):
        assert after[1] >= before[2], f"{after[0]} started while {before[0]} ran"
    # il-2 asked while the forked base job trained: the slot that job freed went to it (the
    # forked runner asks again for each trial, after it has freed the slot).
    assert [j[0] for j in jobs] == ["il-1", "fork.base", "il-2", "fork.a.r0", "fork.b.r0",
                                    "fork.b.r1", "fork.a.r1"]
    assert node.slots.busy == 0
    # the arms of a repeat share its data order, each repeat has its own, none the base's
    assert {n: o for n, o in PacedJob.orders.items() if n.startswith("fork")} == {
        "fork.base": 0, "fork.a.r0": 1, "fork.b.r0": 1, "fork.a.r1": 2, "fork.b.r1": 2}


def test_a_decided_experiment_stops_its_run_and_an_a_over_a_runs_to_its_budget(
        paced: Node) -> None:
    node = paced
    PacedJob.speed = {"fast": 1.3}
    budget = 400  # 40 pairs of 5-step blocks
    ended: list[int] = []
    node.experiment_service.ends.next()  # the waiters below are woken by the runner's on_end

    async def main() -> tuple[int, int]:
        fast = await node.service.submit_experiment(_interleaved("fast", budget, "base", "fast"))
        # Bands no A/A can reach in this budget: it must spend it (neither "no difference"
        # nor futility may end it early).
        same = await node.service.submit_experiment(_interleaved(
            "same", budget, "a", "b", min_effect=0.001, equivalence=0.001))
        await _until_ended(node, fast.id, same.id)
        ended.extend(j[3] for j in sorted(PacedJob.log, key=lambda j: j[1]))
        return fast.id, same.id

    fast_id, same_id = asyncio.run(main())
    fast, same = node.service.experiment(fast_id), node.service.experiment(same_id)
    assert fast is not None and same is not None
    assert fast.state == "done", fast
    v = fast.verdict["fast"]  # type: ignore[index]
    assert v["kind"] == "better" and v["ratio"] > 1.2, v
    assert v["budget_steps"] == budget and v["decided_at_step"] <= budget // 4, v
    fast_run = crud.get_run(node.engine, run_id=fast.run_id)  # type: ignore[arg-type]
    assert fast_run is not None and fast_run.state == "stopped"
    assert ended[0] <= v["decided_at_step"] + 10  # stopped within a block or two
    assert {t.state for t in queue.list_trials(node.engine, experiment_id=fast_id)} == {"done"}

    assert same.state == "done", same
    w = same.verdict["b"]  # type: ignore[index]
    assert w["kind"] in ("no difference", "inconclusive (budget spent)"), w
    assert w["decided_at_step"] == budget and ended[1] == budget
    same_run = crud.get_run(node.engine, run_id=same.run_id)  # type: ignore[arg-type]
    assert same_run is not None and same_run.state == "completed"


def test_an_experiment_goes_on_from_the_pairs_earlier_ones_measured_of_its_comparison(
        paced: Node) -> None:
    """``ExperimentSpec.carry`` (the tuner's later speed rounds): each arm's verdict reads the
    pairs an earlier experiment of the same job, baseline and arm setting counted, then its
    own; an experiment of another baseline gives none."""
    node = paced
    base, arm = {"name": "base", "precision": "fp32"}, {"name": "arm", "precision": "bf16"}
    bands = {"min_effect": 0.001, "equivalence": 0.001}  # nothing decides: every pair counts

    def spec(name: str, *arms: dict[str, Any], **kw: Any) -> ExperimentSpec:
        return ExperimentSpec(name=name, steps=100, block_steps=5, warmup_steps=1,
                              arms=arms, **bands, **kw)  # 10 pairs of 5-step blocks

    async def main() -> tuple[int, int, int]:
        first = await node.service.submit_experiment(spec("first", base, arm))
        other = await node.service.submit_experiment(spec("other", arm, base))
        await _until_ended(node, first.id, other.id)
        second = await node.service.submit_experiment(
            spec("second", {**base, "name": "b"}, {**arm, "name": "a"},
                 carry=(first.id, other.id)))
        await _until_ended(node, second.id)
        return first.id, other.id, second.id

    first_id, other_id, second_id = asyncio.run(main())
    first, second = node.service.experiment(first_id), node.service.experiment(second_id)
    assert first is not None and second is not None and second.state == "done", second
    counted = first.verdict["arm"]["pairs"]  # type: ignore[index]
    assert counted == 10 and first.verdict["arm"]["carried"] == 0  # type: ignore[index]
    v = second.verdict["a"]  # type: ignore[index]
    assert (v["pairs"], v["carried"]) == (counted + 10, counted), v
    assert second.carried_from == (first_id,) and second.carried_pairs == counted
    # the very pairs the first one's verdict read, first in the second's stream
    view = queue.get_experiment(node.engine, experiment_id=second_id)
    assert view is not None
    taken = view.budget["carried"]["pairs"]["a"]
    clipped = robust_log_ratios(taken).values  # as the first's verdict read them
    assert math.exp(float(clipped.mean())) == pytest.approx(
        first.verdict["arm"]["ratio"], rel=1e-9)  # type: ignore[index]
    assert other_id not in view.budget["carried"]["from"]


def test_a_band_left_to_the_node_is_the_one_its_noise_lets_an_a_over_a_reach(
        paced: Node) -> None:
    from traind.daemon.experiments.bands import MIN_NOISE_PAIRS
    from traind.daemon.experiments.stats import DEFAULT_PAIR_NOISE, reachable_band

    node = paced
    budget, pairs = 400, 40  # 40 rounds of 2 arms x 5-step blocks

    async def main() -> list[int]:
        ids = []
        for name, band in (("aa-0", None), ("aa-1", 0.001), ("aa-2", None)):
            # no futility (min_effect ~0): "no gain" may end an A/A first, rightly
            e = await node.service.submit_experiment(_interleaved(
                name, budget, "a", "b", equivalence=band, min_effect=0.001))
            await _until_ended(node, e.id)
            ids.append(e.id)
        return ids

    aa0, aa1, aa2 = (node.service.experiment(i) for i in asyncio.run(main()))
    assert aa0 is not None and aa1 is not None and aa2 is not None
    # nothing measured yet: the assumed noise, and the experiment says so; decided early,
    # its few pairs are too few to be the node's noise on their own
    assert aa0.equivalence == reachable_band(DEFAULT_PAIR_NOISE, pairs)
    assert aa0.equivalence_rule is not None and "assumed" in aa0.equivalence_rule
    v0 = aa0.verdict["b"]  # type: ignore[index]
    assert v0["pairs"] < MIN_NOISE_PAIRS
    # a band the submission sets is kept, and no rule is claimed for it; an A/A cannot reach
    # +-0.1%: it spends its budget, and with aa-0's its 40 pairs measure the node's noise
    assert (aa1.equivalence, aa1.equivalence_rule) == (0.001, None)
    v1 = aa1.verdict["b"]  # type: ignore[index]
    n = v0["pairs"] + v1["pairs"]
    noise = math.sqrt((v0["noise"] ** 2 * v0["pairs"] + v1["noise"] ** 2 * v1["pairs"]) / n)
    assert aa2.equivalence == reachable_band(noise, pairs) < aa0.equivalence
    assert aa2.equivalence_rule == (
        f"auto: the band an A/A reaches in {pairs} pairs at {round(noise * 100, 1):g}% per "
        f"pair, measured over {n} pairs by 2 experiments, the newest {aa1.id}")
    v = aa2.verdict["b"]  # type: ignore[index]
    assert v["kind"] == "no difference" and v["decided_at_step"] < budget, v


RUN, BETTER = {"kind": "running"}, {"kind": "better", "ratio": 1.3}


@pytest.mark.parametrize(("before", "now", "finished", "want"), [
    # decided now: the step and the budget beside it
    ({}, {"b": BETTER}, False, {"b": {**BETTER, "budget_steps": 400, "decided_at_step": 60}}),
    # still running: the budget only
    ({}, {"b": RUN}, False, {"b": {**RUN, "budget_steps": 400}}),
    # decided before: kept as it was then, whatever the blocks say now
    ({"b": {**BETTER, "decided_at_step": 20}}, {"b": {"kind": "no difference"}}, False,
     {"b": {**BETTER, "decided_at_step": 20}}),
    # the run ended by itself with too few pairs: inconclusive, never running
    ({}, {"b": {"kind": "running", "reason": "1 paired blocks so far"}}, True,
     {"b": {"kind": "inconclusive (budget spent)", "budget_steps": 400, "decided_at_step": 60,
            "reason": "the budget ended before a verdict: 1 paired blocks so far"}}),
])
def test_settle_keeps_each_arms_first_decision(before: dict[str, Any], now: dict[str, Any],
                                               finished: bool, want: dict[str, Any]) -> None:
    from traind.daemon.experiments.interleaved import settle

    assert settle(before, now, step=60, budget_steps=400, finished=finished) == want


def test_decided_and_the_state_it_ends_in() -> None:
    from traind.daemon.experiments.interleaved import decided, final_state

    assert not decided({}) and not decided({"b": BETTER, "c": RUN})
    assert decided({"b": BETTER, "c": {"kind": "worse"}})
    assert final_state({"b": BETTER}) == "done"
    assert final_state({"b": BETTER, "c": {"kind": "failed (error)"}}) == "failed"


@pytest.mark.parametrize(("arms", "steps", "least"), [(2, 39, 40), (3, 59, 60)])
def test_a_budget_below_two_rounds_is_refused_naming_steps(
        tmp_path: Path, arms: int, steps: int, least: int) -> None:
    from traind.daemon.config import ConfigError

    node = _node(tmp_path)
    names = [f"arm{i}" for i in range(arms)]
    with pytest.raises(ConfigError, match=f"at least {least}") as err:
        asyncio.run(node.service.submit_experiment(_interleaved("small", steps, *names,
                                                                block_steps=10)))
    assert [loc for loc, _ in err.value.errors] == [("steps",)]
    assert node.service.experiments() == [] and crud.list_runs(node.engine) == []
    # Two full rounds are enough.
    node.supervisor.job_factory = PacedJob

    async def enough() -> str:
        info = await node.service.submit_experiment(_interleaved("enough", least, *names,
                                                                 block_steps=10))
        await node.shutdown()
        return info.state

    assert asyncio.run(enough()) == "running"


def test_a_search_whose_rounds_could_not_hold_two_pairs_is_refused(tmp_path: Path) -> None:
    from traind.daemon.config import ConfigError
    from traind.daemon.service import AutotuneSpec

    node = _node(tmp_path)
    small = AutotuneSpec(name="small", steps=30, block_steps=10)
    with pytest.raises(ConfigError, match="at least 40") as err:
        asyncio.run(node.service.submit_autotune(small))
    assert err.value.errors[0][0][-1] == "steps"
    assert node.service.autotunes() == [] and node.service.experiments() == []
