"""Pipeline parallel (trainer/pipeline_parallel.py): the split and the bubble arithmetic as
tables, then real gloo ranks under torchrun: pp2 under GPipe, 1F1B and interleaved 1F1B (two
looped stages per rank), and pp2 x dp2, follow
the one-rank run's losses and grad norms step by step, and a pp checkpoint resumes on its mesh.

Why not bitwise: the pipeline runs the batch as micro-batches and sums their gradients (scaled
by 1/m) where one rank takes one backward over the whole batch, the stages' squared grad norms
are summed over ranks, and dp ranks average half-batch gradients: the same math in another
order, so float32 rounding differs in the last bits and Adam carries it on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.trainer.mesh_runs import STEPS, config, run_ranks
from traind.contracts.events import (
    EvalEvent,
    LifecycleEvent,
    PipelineEvent,
    PrecisionEvent,
    SNREvent,
    StepEvent,
)
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.pipeline_p2p import p2p_totals
from traind.trainer.pipeline_parallel import (
    measured_bubble,
    rank_stages,
    stage_layers,
    theoretical_bubble,
)
from traind.trainer.sink import ListSink

if TYPE_CHECKING:
    from pathlib import Path

# fp32, relative per step: reordered float32 sums over 8 steps of Adam; measured 1.3e-7 at
# worst for the losses and 3e-7 for the grad norms (pp2 gpipe and 1f1b, pp2 x dp2)
FP32_RTOL = 1e-5


@pytest.mark.parametrize(("n_layers", "stages", "want"), [
    (2, 2, [range(0, 1), range(1, 2)]),
    (4, 2, [range(0, 2), range(2, 4)]),
    (5, 2, [range(0, 3), range(3, 5)]),  # the first stages take the remainder
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
    (4, 4, [range(i, i + 1) for i in range(4)]),
])
def test_stage_layers(n_layers: int, stages: int, want: list[range]) -> None:
    got = [stage_layers(n_layers, stages, s) for s in range(stages)]
    assert got == want
    assert [i for r in got for i in r] == list(range(n_layers))  # every block, once


@pytest.mark.parametrize(("stages", "microbatches", "bubble"), [
    (1, 1, 0.0),  # no pipeline, no bubble
    (2, 1, 0.5),  # one micro-batch: the stages take turns
    (2, 2, 1 / 3),
    (4, 4, 3 / 7),
    (4, 16, 3 / 19),  # more micro-batches shrink it
    (8, 8, 7 / 15),
])
def test_theoretical_bubble(stages: int, microbatches: int, bubble: float) -> None:
    assert theoretical_bubble(stages, microbatches) == pytest.approx(bubble)


@pytest.mark.parametrize(("stages", "microbatches", "virtual", "bubble"), [
    (2, 2, 1, 1 / 3),  # one stage per rank: GPipe's
    (2, 2, 2, 1 / 5),
    (4, 8, 2, 3 / 19),
    (4, 8, 4, 3 / 35),  # more looped stages, shorter fill and drain
])
def test_interleaved_bubble(stages: int, microbatches: int, virtual: int,
                            bubble: float) -> None:
    assert theoretical_bubble(stages, microbatches, virtual) == pytest.approx(bubble)


@pytest.mark.parametrize(("rank", "stages", "virtual", "want"), [
    (0, 2, 1, [0]),
    (1, 2, 2, [1, 3]),
    (2, 4, 2, [2, 6]),
    (0, 2, 3, [0, 2, 4]),
])
def test_rank_stages_loop(rank: int, stages: int, virtual: int, want: list[int]) -> None:
    assert rank_stages(rank, stages, virtual) == want


@pytest.mark.parametrize(("busy", "wall", "bubble"), [
    (0.75, 1.0, 0.25),
    (1.0, 1.0, 0.0),
    (1.1, 1.0, 0.0),  # clock noise never makes it negative
    (0.0, 1.0, 1.0),
    (0.5, 0.0, 0.0),  # an untimed step
])
def test_measured_bubble(busy: float, wall: float, bubble: float) -> None:
    assert measured_bubble(busy, wall) == pytest.approx(bubble)


# -- real ranks -------------------------------------------------------------------------------

def steps(events: list[Any]) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) per step."""
    return {e.step: (e.loss, e.grad_norm) for e in events if isinstance(e, StepEvent)}


def val_loss(events: list[Any]) -> float:
    """The run's last evaluation (every run evaluates at its end)."""
    return [e for e in events if isinstance(e, EvalEvent)][-1].val_loss


def one_rank(cfg: dict[str, Any]) -> tuple[dict[int, tuple[float, float]], float]:
    sink = ListSink()
    train(TrainConfig.model_validate(cfg), sink)
    return steps(sink.events), val_loss(sink.events)


def assert_close(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]],
                 *, norms: bool = True) -> None:
    assert sorted(got) == sorted(want)
    for step, expected in want.items():
        for g, w in zip(got[step], expected if norms else expected[:1], strict=False):
            assert abs(g - w) <= FP32_RTOL * abs(w), (step, got[step], expected)


def p2p_bytes(event: PipelineEvent) -> dict[tuple[str, str], tuple[int, int]]:
    # every op's wait is timed; a stage waits on its recvs (its neighbour's compute)
    assert all(d["seconds"] >= 0 for d in event.p2p)
    assert sum(d["seconds"] for d in event.p2p if d["op"] == "recv") > 0
    return {(d["direction"], d["op"]): (d["calls"], d["bytes"]) for d in event.p2p}


def expected_p2p(rank: int, pp: int, virtual: int, microbatches: int, activation: int
                 ) -> dict[tuple[str, str], tuple[int, int]]:
    """(messages, bytes) per (direction, op) of one step of the rank at pp coordinate
    ``rank``: each of its stages receives activations unless it is the first, sends them on
    unless it is the last, and the gradients go the other way; one tensor per micro-batch."""
    got: dict[tuple[str, str], tuple[int, int]] = {}

    def add(key: tuple[str, str]) -> None:
        calls, nbytes = got.get(key, (0, 0))
        got[key] = (calls + microbatches, nbytes + microbatches * activation)

    for stage in rank_stages(rank, pp, virtual):
        if stage > 0:
            add(("forward", "recv"))
            add(("backward", "send"))
        if stage < pp * virtual - 1:
            add(("forward", "send"))
            add(("backward", "recv"))
    return got


@pytest.mark.parametrize(("rank", "virtual", "want"), [
    (0, 1, {("forward", "send"): (2, 20), ("backward", "recv"): (2, 20)}),
    (1, 1, {("forward", "recv"): (2, 20), ("backward", "send"): (2, 20)}),
    # stages 0 and 2 of 4: the middle one both ways
    (0, 2, {("forward", "send"): (4, 40), ("backward", "recv"): (4, 40),
            ("forward", "recv"): (2, 20), ("backward", "send"): (2, 20)}),
])
def test_expected_p2p(rank: int, virtual: int, want: dict[Any, Any]) -> None:
    assert expected_p2p(rank, 2, virtual, 2, 10) == want


def test_p2p_totals_add_a_ranks_stages() -> None:
    stages = [{("forward", "send"): [2, 100, 0.5]},
              {("forward", "send"): [2, 100, 0.25], ("backward", "recv"): [1, 8, 1.0]}]
    assert p2p_totals(stages) == [
        {"direction": "backward", "op": "recv", "calls": 1, "bytes": 8, "seconds": 1.0},
        {"direction": "forward", "op": "send", "calls": 4, "bytes": 200, "seconds": 0.75}]
    assert "seconds" not in p2p_totals(stages, timed=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "microbatches", "layers", "theory"), [
    ("gpipe", 4, 2, 1 / 5),
    ("1f1b", 2, 2, 1 / 3),
    ("interleaved_1f1b", 2, 4, 1 / 5),  # two looped stages per rank: (2-1)/(2*2+2-1)
])
def test_pp2_follows_one_rank(tmp_path: Path, schedule: str, microbatches: int, layers: int,
                              theory: float) -> None:
    model = {"n_layers": layers}
    reference, reference_val = one_rank(config(tmp_path / "one", batch=4, model=model))
    parallel = {"pp": 2, "pp_schedule": schedule, "microbatches": microbatches}
    ranks = run_ranks(tmp_path / "pp", config(tmp_path / "pp", batch=4, ranks=2, model=model,
                                              parallel=parallel), 2)
    started = next(e for e in ranks[0] if isinstance(e, LifecycleEvent)
                   and e.phase == "started")
    assert started.detail["mesh"] == {"dp": 1, "tp": 1, "pp": 2}
    assert started.detail["strategy"] == "pp"
    # the job's figures are the whole model's; the stage holds part of it
    assert started.detail["pipeline"]["stage_params"] < started.detail["params"]
    # the lead rank (stage 0) reports the last stage's loss, and the norm of all the stages
    assert steps(ranks[0]) == steps(ranks[1])
    assert_close(steps(ranks[0]), reference)
    # evaluation runs the stages forward only; the last one's loss is broadcast
    assert val_loss(ranks[0]) == val_loss(ranks[1])
    assert val_loss(ranks[0]) == pytest.approx(reference_val, rel=FP32_RTOL)
    looped = schedule == "interleaved_1f1b"
    # one micro-batch's residual stream, (B / m, T, C) in float32, crosses each boundary
    # forward, and its gradient (the same shape) backward
    activation = 4 // microbatches * 32 * 32 * 4
    for stage, events in enumerate(ranks):
        pipe = [e for e in events if isinstance(e, PipelineEvent)]
        assert [e.step for e in pipe] == list(range(1, STEPS + 1))
        for e in pipe:
            assert (e.stage, e.stages, e.microbatches, e.schedule) == (
                stage, 2, microbatches, schedule)
            assert e.bubble_theory == pytest.approx(theory)
            assert e.busy_seconds > 0 and e.idle_seconds >= 0 and 0 <= e.bubble < 1
            assert p2p_bytes(e) == expected_p2p(stage, 2, layers // 2 if looped else 1,
                                                microbatches, activation)


@pytest.mark.slow
def test_pp2_with_no_microbatch_count_trains_to_the_end(tmp_path: Path) -> None:
    """``traind run --set job.nproc_per_node=2 --set parallel.pp=2``: parallel.microbatches
    left at 0 is derived (pp = 2 divides the batch of 8), and the 1F1B pipeline trains every
    step as one rank does."""
    reference, _ = one_rank(config(tmp_path / "one", batch=8))
    ranks = run_ranks(tmp_path / "pp", config(tmp_path / "pp", batch=8, ranks=2,
                                              parallel={"pp": 2}), 2)
    for stage, events in enumerate(ranks):
        started = next(e for e in events if isinstance(e, LifecycleEvent)
                       and e.phase == "started")
        assert started.detail["pipeline"]["microbatches"] == 2
        pipe = [e for e in events if isinstance(e, PipelineEvent)]
        assert [(e.step, e.stage, e.microbatches, e.schedule) for e in pipe] == [
            (step, stage, 2, "1f1b") for step in range(1, STEPS + 1)]
        assert any(isinstance(e, LifecycleEvent) and e.phase == "finished" and e.step == STEPS
                   for e in events)
    assert steps(ranks[0]) == steps(ranks[1])
    assert_close(steps(ranks[0]), reference)


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "rtol"), [
    # measured at worst 1.6e-5 (losses) and 8.2e-5 (norms): fp16 rounds each matmul, and
    # micro-batches round other partial sums; the loss scale itself is exact (a power of 2)
    ("fp16", 1e-3),
    # 1.3e-3 and 6.2e-3: torchao's dynamic scaling takes each micro-batch's amax, where one
    # rank takes the whole batch's, so the fp8 roundings themselves differ
    ("fp8", 3e-2),
])
def test_pp2_follows_one_rank_in_low_precision(tmp_path: Path, precision: str,
                                               rtol: float) -> None:
    mode = {"mode": precision}
    reference, _ = one_rank(config(tmp_path / "one", batch=4, precision=mode))
    ranks = run_ranks(tmp_path / "pp", config(tmp_path / "pp", batch=4, ranks=2, precision=mode,
                                              parallel={"pp": 2, "microbatches": 2}), 2)
    got = steps(ranks[0])
    assert got == steps(ranks[1]) and sorted(got) == sorted(reference)
    for step, (loss, norm) in reference.items():
        assert got[step][0] == pytest.approx(loss, rel=rtol / 3), step
        assert got[step][1] == pytest.approx(norm, rel=rtol), step


@pytest.mark.slow
def test_pp2_adaptive_decides_each_stage_and_every_rank_knows_the_whole_model(
        tmp_path: Path) -> None:
    """Stage 0 holds block.0, stage 1 block.1 and the head: each measures and switches its
    own groups (another stage's never get a gradient here), and every window's figures are
    shared, so both ranks report every group, as one rank does."""
    mode = {"mode": "adaptive", "snr_window": 2, "snr_high": 0.02, "snr_low": 0.01,
            "min_dwell": 2}  # thresholds a tiny model's gradients cross within 8 steps
    sink = ListSink()
    train(TrainConfig.model_validate(config(tmp_path / "one", batch=4, precision=mode)), sink)
    reference = steps(sink.events)
    ranks = run_ranks(tmp_path / "pp", config(tmp_path / "pp", batch=4, ranks=2, precision=mode,
                                              parallel={"pp": 2, "microbatches": 2}), 2)

    def switches(events: list[Any]) -> list[tuple[int, str, str]]:
        return [(e.step, e.group, e.after) for e in events if isinstance(e, PrecisionEvent)]

    def reports(events: list[Any]) -> list[tuple[int, list[str], list[str]]]:
        return [(e.window_step, e.groups, e.modes) for e in events if isinstance(e, SNREvent)]

    want = switches(sink.events)
    assert {g for _, g, _ in want} == {"block.0", "block.1", "head"}  # both stages switch
    assert switches(ranks[0]) == switches(ranks[1]) == want
    assert reports(ranks[0]) == reports(ranks[1]) == reports(sink.events)
    got = steps(ranks[0])
    for step, (loss, _) in reference.items():  # bf16 blocks: the fp16 case's tolerance
        assert got[step][0] == pytest.approx(loss, rel=1e-3), step


@pytest.mark.slow
def test_pp2_dp2_follows_one_rank_of_the_whole_batch(tmp_path: Path) -> None:
    reference, _ = one_rank(config(tmp_path / "one", batch=8))
    ranks = run_ranks(tmp_path / "4", config(tmp_path / "4", batch=4, ranks=4,
                                             parallel={"pp": 2, "microbatches": 2}), 4)
    # (pp, dp) = rank // 2, rank % 2: ranks 0 and 2 are one pipeline, 1 and 3 the other
    per_rank = [steps(events) for events in ranks]
    assert per_rank[0] == per_rank[2] and per_rank[1] == per_rank[3]
    assert per_rank[0] != per_rank[1]  # the two dp groups read different halves
    mean = {s: ((per_rank[0][s][0] + per_rank[1][s][0]) / 2,) for s in per_rank[0]}
    assert_close(mean, reference, norms=False)
    # the gradients are averaged over dp before the norm: one norm, the whole batch's
    assert_close({s: v[1:] for s, v in per_rank[0].items()},
                 {s: v[1:] for s, v in reference.items()})


@pytest.mark.slow
def test_pp2_checkpoint_resumes_on_the_same_mesh(tmp_path: Path) -> None:
    parallel = {"pp": 2, "microbatches": 2}
    # the uninterrupted run: the one-rank one, which pp2 follows (the test above); in process,
    # a few seconds less than another torchrun job
    whole, _ = one_rank(config(tmp_path / "one", batch=4))
    half = STEPS // 2
    out = tmp_path / "split"
    run_ranks(out, config(out, batch=4, ranks=2, steps=half, parallel=parallel), 2)
    assert (out / f"dcp_step_{half:08d}").is_dir()  # each stage its own slice: DCP
    resumed = run_ranks(out / "again", config(out, batch=4, ranks=2, parallel=parallel), 2)
    got = steps(resumed[0])
    assert sorted(got) == list(range(half + 1, STEPS + 1))
    assert_close(got, {s: v for s, v in whole.items() if s > half})
