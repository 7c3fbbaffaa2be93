"""The numerics policy: the pure checks by table, then real runs with NaN and x20 loss spikes
injected into chosen batches, checking the exact steps skipped, rolled back or failed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from traind.contracts.events import NumericsEvent, StepEvent, decode, encode
from traind.trainer.checkpoint import latest, load_checkpoint
from traind.trainer.config import NumericsConfig, TrainConfig
from traind.trainer.loop import train
from traind.trainer.model import GPT
from traind.trainer.numerics import (
    LOSS_SPIKE,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    NumericsError,
    NumericsGuard,
    inspect,
    spike_limit,
)
from traind.trainer.sink import ListSink

MakeConfig = Callable[..., TrainConfig]
NAN, INF = math.nan, math.inf
FLAT = [1.0, 1.2, 0.8, 1.0, 1.0]  # mean 1, population std sqrt(0.016) = 0.12649


@pytest.mark.parametrize(("loss", "grad", "window", "check_grads", "reason"), [
    (1.0, 1.0, FLAT, True, None),
    (NAN, 1.0, FLAT, True, NONFINITE_LOSS),
    (INF, NAN, FLAT, True, NONFINITE_LOSS),  # the loss is named first
    (1.0, INF, FLAT, True, NONFINITE_GRAD),
    (1.0, NAN, FLAT, False, None),  # a GradScaler deals with it
    (1.0 + 3 * 0.1264, 1.0, FLAT, True, None),  # just under mean + 3 std
    (1.0 + 3 * 0.1265, 1.0, FLAT, True, LOSS_SPIKE),
    (20.0, 1.0, FLAT[:4], True, None),  # the window is not full yet
    (0.1, 1.0, FLAT, True, None),  # a sudden drop is no spike
])
def test_inspect(loss: float, grad: float, window: list[float], check_grads: bool,
                 reason: str | None) -> None:
    found = inspect(loss, grad, window, sigmas=3.0, window_size=5, check_grads=check_grads)
    assert (found.reason if found else None) == reason


def test_spike_limit_and_no_spike_check_at_zero_sigmas() -> None:
    assert spike_limit(FLAT, 2.0) == pytest.approx(1.0 + 2 * math.sqrt(0.016))
    assert inspect(1e9, 1.0, FLAT, sigmas=0.0, window_size=5) is None


def test_flagged_losses_stay_out_of_the_window() -> None:
    guard = NumericsGuard(NumericsConfig(policy="skip_step", spike_sigmas=3, spike_window=3))
    for loss in (2.0, 2.1, 1.9):
        assert guard.check(loss, 1.0, check_grads=True) is None
    spike = guard.check(40.0, 1.0, check_grads=True)
    assert spike is not None and spike.reason == LOSS_SPIKE and spike.value == 40.0
    assert guard.state_dict() == {"window": [2.0, 2.1, 1.9]}
    assert guard.check(2.0, NAN, check_grads=True) is not None
    assert guard.state_dict() == {"window": [2.0, 2.1, 1.9]}
    restored = NumericsGuard(guard.cfg)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()


def test_numerics_event_round_trips_nan() -> None:
    event = NumericsEvent(rank=1, step=7, action="skip_step", reason=NONFINITE_LOSS, value=NAN)
    back = decode(encode(event))
    assert isinstance(back, NumericsEvent) and back.step == 7 and math.isnan(back.value)


# -- injected into real runs -------------------------------------------------------------------

class _NanGrad(torch.autograd.Function):
    """The loss unchanged going forward, NaN gradients coming back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.nan)


def inject(nan_loss: Iterable[int] = (), nan_grad: Iterable[int] = (),
           spike: Iterable[int] = ()) -> Callable[..., Any]:
    """A GPT.forward that spoils the loss of the given training batches (1-based, in the order
    the loop draws them; evaluation passes are left alone)."""
    original = GPT.forward
    bad = {"nan": set(nan_loss), "grad": set(nan_grad), "spike": set(spike)}
    drawn = [0]

    def forward(self: GPT, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, loss = original(self, idx, targets)
        if self.training and loss is not None:
            drawn[0] += 1
            if drawn[0] in bad["nan"]:
                loss = loss * math.nan
            if drawn[0] in bad["grad"]:
                loss = _NanGrad.apply(loss)
            if drawn[0] in bad["spike"]:
                loss = loss * 20
        return logits, loss

    return forward


def with_numerics(cfg: TrainConfig, **numerics: Any) -> TrainConfig:
    return cfg.model_copy(update={"numerics": NumericsConfig(**numerics)})


def actions(sink: ListSink) -> list[tuple[int, str, str]]:
    return [(e.step, e.action, e.reason) for e in sink.events if isinstance(e, NumericsEvent)]


def final_state(out_dir: Path) -> dict[str, Any]:
    path = latest(out_dir)
    assert path is not None
    return load_checkpoint(path)


def updates(state: dict[str, Any]) -> int:
    """Optimizer updates AdamW actually took (its per-parameter step count)."""
    return int(state["optimizer"]["state"][0]["step"])


def test_skip_step_drops_exactly_the_bad_steps(tmp_path: Path, make_config: MakeConfig,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPT, "forward", inject(nan_loss=[7], nan_grad=[9], spike=[15]))
    cfg = with_numerics(make_config(tmp_path, steps=20), policy="skip_step", spike_sigmas=6,
                        spike_window=10)
    sink = ListSink()
    result = train(cfg, sink)
    assert actions(sink) == [(7, "skip_step", NONFINITE_LOSS), (9, "skip_step", NONFINITE_GRAD),
                             (15, "skip_step", LOSS_SPIKE)]
    assert result.step == 20
    state = final_state(tmp_path)
    assert updates(state) == 17 and state["sampler"]["index"] == 20
    steps = {e.step: e for e in sink.events if isinstance(e, StepEvent)}
    assert steps[7].nonfinite and not steps[8].nonfinite
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_rollback_restores_the_checkpoint_and_skips_the_batches(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    # Batch b is trained at step b until the first rollback, then at b - 5, then at b - 13.
    monkeypatch.setattr(GPT, "forward", inject(spike=[25], nan_loss=[33]))
    cfg = with_numerics(make_config(tmp_path, steps=40, checkpoint_every=10, eval_every=100),
                        policy="rollback", spike_sigmas=6, spike_window=10)
    sink = ListSink()
    result = train(cfg, sink)
    events = [e for e in sink.events if isinstance(e, NumericsEvent)]
    assert [(e.step, e.action, e.reason, e.resume_step, e.skipped_batches) for e in events] == [
        (25, "rollback", LOSS_SPIKE, 20, 5), (28, "rollback", NONFINITE_LOSS, 20, 8)]
    assert events[0].value > events[0].limit
    assert result.step == 40
    state = final_state(tmp_path)
    assert updates(state) == 40  # the rolled-back updates were undone with the weights
    assert state["sampler"]["index"] == 40 + 5 + 8  # and their batches never come back
    reported = [e.step for e in sink.events if isinstance(e, StepEvent)]
    assert reported == [*range(1, 25), *range(21, 28), *range(21, 41)]


def test_rollback_before_the_first_checkpoint_goes_to_step_zero(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPT, "forward", inject(nan_grad=[3]))
    cfg = with_numerics(make_config(tmp_path, steps=6), policy="rollback")
    sink = ListSink()
    train(cfg, sink)
    events = [e for e in sink.events if isinstance(e, NumericsEvent)]
    assert [(e.step, e.resume_step, e.skipped_batches) for e in events] == [(3, 0, 3)]
    state = final_state(tmp_path)
    assert updates(state) == 6 and state["sampler"]["index"] == 9


def test_rollbacks_that_do_not_get_past_the_trouble_fail(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPT, "forward", inject(nan_loss=range(12, 100)))
    cfg = with_numerics(make_config(tmp_path, steps=30, checkpoint_every=10),
                        policy="rollback", max_rollbacks=2)
    sink = ListSink()
    with pytest.raises(NumericsError, match="2 rollbacks"):
        train(cfg, sink)
    assert actions(sink) == [(12, "rollback", NONFINITE_LOSS), (11, "rollback", NONFINITE_LOSS),
                             (11, "fail", NONFINITE_LOSS)]


def test_fail_ends_the_run_with_a_clear_error(tmp_path: Path, make_config: MakeConfig,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPT, "forward", inject(nan_loss=[4]))
    sink = ListSink()
    with pytest.raises(NumericsError, match=r"non-finite loss at step 4.*policy is fail"):
        train(with_numerics(make_config(tmp_path, steps=10), policy="fail"), sink)
    assert actions(sink) == [(4, "fail", NONFINITE_LOSS)]


def test_rollback_needs_an_out_dir(make_config: MakeConfig) -> None:
    with pytest.raises(ValueError, match=r"needs job\.out_dir"):
        train(with_numerics(make_config(None, steps=2), policy="rollback"), ListSink())


def test_off_leaves_nan_to_run_on(tmp_path: Path, make_config: MakeConfig,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPT, "forward", inject(nan_loss=[2]))
    sink = ListSink()
    train(make_config(tmp_path, steps=3), sink)
    assert actions(sink) == []


def test_fp16_scaler_keeps_skipping_inf_gradients_under_skip_step(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPT, "forward", inject(nan_grad=[5], nan_loss=[8]))
    cfg = with_numerics(make_config(tmp_path, steps=10), policy="skip_step", spike_sigmas=0)
    cfg = cfg.model_copy(update={"precision": cfg.precision.model_copy(update={
        "mode": "fp16"})})
    sink = ListSink()
    train(cfg, sink)
    # The scaler skipped step 5 itself (no numerics action); the policy dropped step 8.
    assert actions(sink) == [(8, "skip_step", NONFINITE_LOSS)]
    steps = {e.step: e for e in sink.events if isinstance(e, StepEvent)}
    assert steps[5].skipped_steps == 1 and steps[9].skipped_steps == 0
    assert steps[8].loss_scale < steps[7].loss_scale  # its inf gradients still backed off


# -- two gloo ranks: one rank's trouble, every rank's action -----------------------------------

def _rank(rank: int, init: str, cfg: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 1:  # only this rank sees the NaN and the spike
            GPT.forward = inject(nan_loss=[6], spike=[15])  # type: ignore[method-assign]
        sink = ListSink()
        train(TrainConfig.model_validate(cfg), sink)
        queue.put((rank, actions(sink)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_takes_the_same_action_at_the_same_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spawned ranks unpickle ``_rank`` from this module, found from the repository root.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    cfg = {
        "job": {"steps": 20, "batch_size": 4, "threads": 1, "out_dir": str(tmp_path / "out"),
                "eval_every": 100, "checkpoint_every": 100, "device": "cpu"},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 100_000}, "optim": {"warmup_steps": 5, "lr": 1e-2},
        "telemetry": {"per_layer": False},
        "numerics": {"policy": "skip_step", "spike_window": 10, "spike_sigmas": 6},
    }
    queue = mp.get_context("spawn").Queue()
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_rank, args=(init, cfg, queue), nprocs=2, start_method="spawn")
    got = dict(queue.get(timeout=10) for _ in range(2))
    expected = [(6, "skip_step", NONFINITE_LOSS), (15, "skip_step", LOSS_SPIKE)]
    assert got == {0: expected, 1: expected}
