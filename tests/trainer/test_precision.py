"""Precision policies: the pure decisions by tables, the SNR math against a direct computation,
the fp16 scaler on CPU, and a tiny GPT trained under every mode this machine can run."""

from __future__ import annotations

import io
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from traind.contracts.events import SNREvent
from traind.trainer import precision
from traind.trainer.config import ModelConfig, OptimConfig, PrecisionConfig
from traind.trainer.model import GPT
from traind.trainer.optim import build_optimizer, clip_grad_norm
from traind.trainer.precision import (
    POLICIES,
    AdaptivePolicy,
    FP8Policy,
    PrecisionPolicy,
    SNRTracker,
    Switch,
    build_policy,
    fp8_converts,
    fp8_unsupported_reason,
    next_mode,
    snr_from_moments,
)

CPU = torch.device("cpu")
CFG = PrecisionConfig(snr_low=1.0, snr_high=4.0, min_dwell=32, low="bf16")

# -- pure decisions --------------------------------------------------------------------------


@pytest.mark.parametrize(("current", "snr", "since", "cfg", "expected"), [
    ("fp32", 10.0, 32, CFG, "bf16"),  # clean signal, dwelt long enough: drop
    ("fp32", 10.0, 31, CFG, "fp32"),  # ... but not before min_dwell
    ("fp32", 4.0, 100, CFG, "fp32"),  # "above" is strict
    ("fp32", 2.0, 100, CFG, "fp32"),  # inside the band: stay
    ("bf16", 2.0, 100, CFG, "bf16"),  # inside the band: stay (hysteresis)
    ("bf16", 0.5, 100, CFG, "fp32"),  # noisy: back to fp32
    ("bf16", 0.5, 0, CFG, "bf16"),  # just switched: dwell first
    ("bf16", 1.0, 100, CFG, "bf16"),  # "below" is strict
    ("fp32", 0.1, 100, CFG, "fp32"),  # already fp32
    ("bf16", 10.0, 100, CFG, "bf16"),  # already low
    ("fp32", math.inf, 100, CFG, "bf16"),  # constant gradient
    ("bf16", math.nan, 100, CFG, "bf16"),  # no information: stay
    ("fp32", 10.0, 0, CFG.model_copy(update={"min_dwell": 0}), "bf16"),
    ("fp32", 10.0, 100, CFG.model_copy(update={"low": "fp16"}), "fp16"),
    ("fp16", 0.5, 100, CFG.model_copy(update={"low": "fp16"}), "fp32"),
])
def test_next_mode(current: str, snr: float, since: int, cfg: PrecisionConfig,
                   expected: str) -> None:
    assert next_mode(current, snr, since, cfg) == expected


@pytest.mark.parametrize(("cuda", "cap", "ao", "says"), [
    (True, (9, 0), True, None),  # Hopper
    (True, (8, 9), True, None),  # Ada
    (True, (10, 0), True, None),  # Blackwell
    (False, None, True, None),  # the CPU: torchao's emulation
    (True, (8, 0), True, "8.9+ (Ada/Hopper) for its fp8 tensor cores; this GPU has compute "
                         "capability 8.0"),  # Ampere
    (True, (7, 5), True, "this GPU has compute capability 7.5"),
    (True, None, True, "compute capability unknown"),
    (True, (9, 0), False, "needs torchao"),
    (False, None, False, "needs torchao"),
])
def test_fp8_requirement(cuda: bool, cap: tuple[int, int] | None, ao: bool,
                         says: str | None) -> None:
    reason = fp8_unsupported_reason(cuda, cap, ao)
    if says is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith("precision.mode: fp8 needs ")
        assert says in reason
        if not ao:  # the one line says what to install
            assert "pip install 'traind[fp8]'" in reason


@pytest.mark.parametrize(("fqn", "k", "n", "recipe", "emulated", "converts"), [
    ("head", 256, 256, "tensorwise", True, False),  # never the output head
    ("blocks.0.attn.qkv", 32, 96, "tensorwise", True, True),  # emulated: every other layer
    ("blocks.0.attn.qkv", 24, 96, "tensorwise", True, False),  # dims not multiples of 16
    ("blocks.0.mlp.down", 96, 40, "rowwise", True, False),
    ("blocks.0.attn.qkv", 256, 768, "tensorwise", False, False),  # GPU: too small to gain
    ("blocks.0.attn.qkv", 2048, 6144, "tensorwise", False, True),  # N > 1024
    ("blocks.0.mlp.down", 8192, 1024, "tensorwise", False, True),  # K > 4096
    ("blocks.0.mlp.down", 4096, 1024, "tensorwise", False, False),
    ("blocks.0.attn.qkv", 2048, 6144, "rowwise", False, True),  # rowwise: N > 4096, K > 1024
    ("blocks.0.attn.proj", 2048, 2048, "rowwise", False, False),  # N <= 2048
    ("blocks.0.attn.proj", 2048, 4096, "rowwise", False, False),  # N <= 4096 and K <= 2048
    ("blocks.0.attn.proj", 4096, 4096, "rowwise", False, True),
    ("blocks.0.mlp.down", 1024, 8192, "rowwise", False, False),  # K <= 1024
])
def test_fp8_converts(fqn: str, k: int, n: int, recipe: str, emulated: bool,
                      converts: bool) -> None:
    assert fp8_converts(fqn == "head", k, n, recipe=recipe, emulated=emulated) is converts


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gpu_thresholds_are_torchaos(recipe: str) -> None:
    """Ours agree with torchao's own auto filter (the home of the measured thresholds) on a
    grid of shapes; ours is a pure function, so the table above can hold it."""
    from torchao.float8 import _auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, filter_fqns=["head"])
    for k, n in itertools.product((512, 1024, 1040, 2048, 4096, 4112, 8192), repeat=2):
        assert fp8_converts(False, k, n, recipe=recipe, emulated=False) == theirs(
            nn.Linear(k, n, bias=False, device="meta"), "blocks.0.x"), (k, n)


def test_fp8_without_torchao_is_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "torchao_available", lambda: False)
    with pytest.raises(ValueError, match=r"precision\.mode: fp8 needs torchao .*traind\[fp8\]"):
        build_policy(PrecisionConfig(mode="fp8"), CPU)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_converts_the_blocks_linear_layers_in_emulation(recipe: str) -> None:
    from torchao.float8.float8_linear import Float8Linear

    policy = build_policy(PrecisionConfig(mode="fp8", fp8_recipe=recipe), CPU)
    assert isinstance(policy, FP8Policy) and policy.emulated
    model = GPT(MODEL)
    weights = {n: p for n, p in model.named_parameters()}
    assert policy.prepare(model) is model
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {f"blocks.{i}.{name}" for i in range(2)
                   for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.gate",
                                 "mlp.up", "mlp.down")}
    assert set(policy.converted) == fp8 and not isinstance(model.head, Float8Linear)
    layer = model.blocks[0].attn.q
    assert isinstance(layer, Float8Linear) and layer.config.emulate
    granularity = {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    assert layer.config.cast_config_weight.scaling_granularity.value == granularity
    # the same Parameters: the optimizer built after prepare() updates what the model uses
    assert dict(model.named_parameters()) == weights


def test_registry_covers_every_mode() -> None:
    modes = PrecisionConfig.model_fields["mode"].annotation.__args__  # type: ignore[union-attr]
    assert set(POLICIES) == set(modes)


@pytest.mark.parametrize(("mean", "var", "count", "expected"), [
    (4.0, 2.0, 16, 8.0),  # mean² / var
    (1.0, 1 / 30, 16, 30.0),  # a norm varying by ~18% (1/sqrt(30))
    (0.0, 1.0, 8, 0.0),
    (1.0, 0.0, 8, math.inf),  # a constant norm
    (0.0, 0.0, 8, math.nan),  # no gradient at all
    (4.0, math.nan, 8, math.nan),
    (4.0, 2.0, 1, math.nan),  # one step has no variance
    (4.0, 2.0, 0, math.nan),
])
def test_snr_from_moments(mean: float, var: float, count: int, expected: float) -> None:
    got = snr_from_moments(mean, var, count)
    assert got == expected or (math.isnan(expected) and math.isnan(got))


def _simulate(snrs: list[float], cfg: PrecisionConfig) -> list[int]:
    """Steps at which a group switches when window k (ending at step (k+1)·window) measures
    snrs[k]: how AdaptivePolicy.after_step applies next_mode."""
    mode, last, switched = "fp32", 0, []
    for k, snr in enumerate(snrs):
        step = (k + 1) * cfg.snr_window
        new = next_mode(mode, snr, step - last, cfg)
        if new != mode:
            mode, last = new, step
            switched.append(step)
    return switched


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1.0, max_value=4.0), max_size=200),
       st.integers(2, 32), st.integers(0, 100))
def test_noise_inside_the_band_never_switches(snrs: list[float], window: int,
                                              dwell: int) -> None:
    cfg = PrecisionConfig(snr_low=1.0, snr_high=4.0, snr_window=window, min_dwell=dwell)
    assert _simulate(snrs, cfg) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=100.0), max_size=200),
       st.integers(2, 32), st.integers(0, 100))
def test_switches_are_min_dwell_apart(snrs: list[float], window: int, dwell: int) -> None:
    cfg = PrecisionConfig(snr_low=1.0, snr_high=4.0, snr_window=window, min_dwell=dwell)
    steps = [0, *_simulate(snrs, cfg)]  # the start counts as the first "switch"
    assert all(b - a >= dwell for a, b in itertools.pairwise(steps))


# -- SNR math --------------------------------------------------------------------------------


def _record(groups: dict[str, list[nn.Parameter]], grads: list[list[torch.Tensor]],
            window: int = 64) -> SNRTracker:
    tracker = SNRTracker(groups, window)
    params = [p for ps in groups.values() for p in ps]
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        tracker.record()
    return tracker


def test_snr_matches_direct_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c = (nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,), (2, 2)))
    groups = {"g0": [a, b], "g1": [c]}
    # each step's gradient of another scale, so the norms vary
    seq = [[torch.full(p.shape, 0.3) + s * torch.randn(p.shape, generator=gen)
            for p, s in ((a, 0.5), (b, 0.1), (c, 2.0))] for _ in range(7)]
    got = _record(groups, seq).snr()

    def direct(idx: list[int]) -> float:
        norms = torch.tensor([math.sqrt(sum(float(step[i].double().square().sum())
                                            for i in idx)) for step in seq], dtype=torch.float64)
        return float(norms.mean() ** 2 / norms.var(unbiased=True))

    assert got["g0"] == pytest.approx(direct([0, 1]), rel=1e-4)
    assert got["g1"] == pytest.approx(direct([2]), rel=1e-4)


def test_snr_by_hand() -> None:
    p = nn.Parameter(torch.zeros(2))
    # grads (3,4), (6,8): norms 5 and 10 -> mean 7.5, sample variance 12.5 -> SNR 4.5
    tracker = _record({"g": [p]}, [[torch.tensor([3.0, 4.0])], [torch.tensor([6.0, 8.0])]])
    assert tracker.snr()["g"] == pytest.approx(4.5)
    tracker.reset()
    assert tracker.count == 0
    assert math.isnan(tracker.snr()["g"])  # fewer than 2 steps: no estimate


def test_snr_constant_gradient_is_infinite() -> None:
    p = nn.Parameter(torch.zeros(10))
    tracker = _record({"g": [p]}, [[torch.linspace(-1, 1, 10)]] * 8)
    assert tracker.snr()["g"] == math.inf


def test_snr_separates_a_steady_norm_from_a_jumping_one() -> None:
    """Noise of one scale (a steady regime) reads high whatever its direction; a window in
    which the gradient's size jumps (a loss spike, the first steps) reads low."""
    gen = torch.Generator().manual_seed(1)
    p, q = nn.Parameter(torch.zeros(4000)), nn.Parameter(torch.zeros(4000))
    scales = [1.0] * 12 + [4.0] * 4  # 4 steps of 4x the gradient
    tracker = _record({"steady": [p], "jumping": [q]},
                      [[torch.randn(4000, generator=gen), s * torch.randn(4000, generator=gen)]
                       for s in scales], window=16)
    snr = tracker.snr()
    # a norm of 4000 unit normals varies by ~1.1%: SNR in the thousands
    assert snr["steady"] > 1000
    # norms 1 (x12) and 4 (x4): mean 1.75, variance 1.8 -> SNR 1.7, under snr_low's default
    assert snr["jumping"] == pytest.approx(1.7, rel=0.05)
    assert snr["jumping"] < PrecisionConfig().snr_low < PrecisionConfig().snr_high < snr["steady"]


def test_tracker_keeps_at_most_a_window_of_steps() -> None:
    p = nn.Parameter(torch.zeros(3))
    tracker = _record({"g": [p]}, [[torch.ones(3) * (i + 1)] for i in range(6)], window=4)
    assert tracker.count == 4  # steps past the window's end (never reached by the policy) drop
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0]) * math.sqrt(3)
    assert tracker.snr()["g"] == pytest.approx(float(norms.mean() ** 2 / norms.var()))


# -- fp16 loss scaling on CPU ----------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_inf_gradient_skips_the_step_and_halves_the_scale(fused: bool) -> None:
    policy = build_policy(PrecisionConfig(mode="fp16", init_scale=1024.0), CPU)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None,
                            foreach=None if fused else True)
    x = torch.randn(8, 4)

    def one_step(poison: bool) -> bool:
        with policy.autocast():
            y = model(x)
        assert y.dtype == torch.float16
        policy.backward(y.float().square().mean())
        if poison:
            model.weight.grad[0, 0] = math.inf  # type: ignore[index]
        policy.unscale(opt)
        clip_grad_norm(model.parameters(), 1.0)
        stepped = policy.step(opt)
        opt.zero_grad(set_to_none=True)
        return stepped

    before = model.weight.detach().clone()
    assert not one_step(poison=True)
    assert torch.equal(model.weight, before)  # the update was skipped
    assert policy.loss_scale == 512.0
    assert policy.skipped == 1
    assert one_step(poison=False)
    assert not torch.equal(model.weight, before)
    assert policy.skipped == 1
    assert policy.loss_scale == 512.0  # grows only after growth_interval clean steps


# -- training a tiny GPT ---------------------------------------------------------------------

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)
TEXT = torch.tensor(list(b"def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 40))


def _batch(gen: torch.Generator, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(TEXT) - MODEL.seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([TEXT[s:s + MODEL.seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]  # (B, T) each


def _forward_backward_step(policy: PrecisionPolicy, model: nn.Module,
                           opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One optimizer step of ``model`` on the next batch of ``gen``, without clipping."""
    with policy.autocast():
        _, loss = model(*_batch(gen))
    assert loss is not None
    policy.backward(loss)
    policy.step(opt)
    opt.zero_grad(set_to_none=True)


def _train(policy: PrecisionPolicy, steps: int = 30) -> tuple[GPT, torch.optim.Optimizer,
                                                              list[float], list[Switch]]:
    """The loop's per-step call sequence, as documented in trainer/precision.py."""
    torch.manual_seed(0)
    model = policy.prepare(GPT(MODEL))
    assert isinstance(model, GPT)
    opt = build_optimizer(model, OptimConfig(lr=1e-2), CPU)
    gen = torch.Generator().manual_seed(0)
    losses: list[float] = []
    switches: list[Switch] = []
    for step in range(1, steps + 1):
        x, y = _batch(gen)
        with policy.autocast():
            _, loss = model(x, y)
        assert loss is not None
        policy.backward(loss)
        policy.unscale(opt)
        clip_grad_norm(model.parameters(), 1.0)
        policy.step(opt)
        opt.zero_grad(set_to_none=True)
        switches += policy.after_step(step)
        losses.append(loss.item())
    return model, opt, losses, switches


def _assert_fp32_master(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float32
        assert state["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "adaptive"])
def test_tiny_gpt_trains(mode: str) -> None:
    # window 4 and no dwell so adaptive really switches inside 30 steps
    cfg = PrecisionConfig(mode=mode, snr_window=4, snr_low=1e-4, snr_high=1e-3, min_dwell=0)
    policy = build_policy(cfg, CPU)
    model, opt, losses, _ = _train(policy)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, losses
    _assert_fp32_master(model, opt)


# fp8 (e4m3 activations and weights, e5m2 gradients, dynamic scales) against bf16 on the same
# tiny GPT, data and seed, emulated on the CPU: measured here, the mean loss of the last 10 of
# 80 steps (about 0.16 nats, from 5.5) differs from bf16's by 0.054 nats (tensorwise) and
# 0.004 (rowwise). The margin leaves room for rounding differences, not for a run that stalls.
FP8_STEPS = 80
FP8_MARGIN = 0.1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_within_a_margin_of_bf16(recipe: str) -> None:
    cfg = PrecisionConfig(mode="fp8", fp8_recipe=recipe)
    model, opt, fp8, _ = _train(build_policy(cfg, CPU), steps=FP8_STEPS)
    _, _, bf16, _ = _train(build_policy(PrecisionConfig(mode="bf16"), CPU), steps=FP8_STEPS)
    first, last = sum(fp8[:5]) / 5, sum(fp8[-10:]) / 10
    print(recipe, "fp8", round(last, 4), "bf16", round(sum(bf16[-10:]) / 10, 4))
    assert last < first - 1.5, fp8  # it learned
    assert abs(last - sum(bf16[-10:]) / 10) < FP8_MARGIN, (fp8[-10:], bf16[-10:])
    _assert_fp32_master(model, opt)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_adaptive_switches_and_computes_blocks_in_low_precision(low: str) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[low]
    cfg = PrecisionConfig(mode="adaptive", low=low, snr_window=4, snr_low=1e-4,
                          snr_high=1e-3, min_dwell=8)
    policy = build_policy(cfg, CPU)
    assert isinstance(policy, AdaptivePolicy)
    model, opt, _, switches = _train(policy, steps=12)
    # SNR is at least ~1/window = 0.25 > snr_high; min_dwell 8 holds the first window back
    assert {(s.group, s.before, s.after) for s in switches} == {
        ("block.0", "fp32", low), ("block.1", "fp32", low), ("head", "fp32", low)}
    assert all(s.snr > cfg.snr_high for s in switches)
    assert policy.modes() == {"embed": "fp32", "block.0": low, "block.1": low, "head": low}
    assert set(policy.last_snr()) == {"block.0", "block.1", "head"}
    assert policy.after_step(13) == []  # mid-window: nothing to decide

    seen: dict[str, torch.dtype] = {}
    for name, mod in (("q", model.blocks[0].attn.q), ("head", model.head),
                      ("emb", model.tok_emb)):
        mod.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    with policy.autocast():
        model(*_batch(torch.Generator().manual_seed(1)))
    assert seen == {"q": dtype, "head": dtype, "emb": torch.float32}
    assert not torch.is_autocast_enabled("cpu")  # every block's context was left
    _assert_fp32_master(model, opt)

    policy.close()  # hooks gone: the model computes in fp32 again
    seen.clear()
    model(*_batch(torch.Generator().manual_seed(1)))
    assert seen == {"q": torch.float32, "head": torch.float32, "emb": torch.float32}


def test_adaptive_fp32_block_ignores_an_outer_autocast() -> None:
    policy = build_policy(PrecisionConfig(mode="adaptive"), CPU)
    model = policy.prepare(GPT(MODEL))
    seen: list[torch.dtype] = []
    model.blocks[0].attn.q.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(*_batch(torch.Generator().manual_seed(1)))
    assert seen == [torch.float32]


def test_adaptive_block_context_is_left_on_an_exception() -> None:
    policy = build_policy(PrecisionConfig(mode="adaptive"), CPU)
    policy.load_state_dict({"modes": {"block.0": "bf16"}})  # before prepare: applied there
    model = policy.prepare(GPT(MODEL))

    def boom(module: nn.Module, args: object, out: object) -> None:
        raise RuntimeError("boom")

    model.blocks[0].attn.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(*_batch(torch.Generator().manual_seed(1)))
    assert not torch.is_autocast_enabled("cpu")


def _replace_parameters(module: nn.Module) -> None:
    """What FSDP's fully_shard does after prepare(): new Parameter objects on the module."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(p.detach().clone()))


def test_adaptive_binds_to_the_parameters_of_the_first_step() -> None:
    cfg = PrecisionConfig(mode="adaptive", snr_window=4, snr_low=0.01, snr_high=0.1,
                          min_dwell=0)
    policy = build_policy(cfg, CPU)
    assert isinstance(policy, AdaptivePolicy)
    model = policy.prepare(GPT(MODEL))
    _replace_parameters(model)  # before the optimizer, as the loop wraps
    opt = build_optimizer(model, OptimConfig(lr=1e-2), CPU)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        _forward_backward_step(policy, model, opt, gen)
        switches = policy.after_step(step)
    snrs = policy.last_snr()
    assert set(snrs) == {"block.0", "block.1", "head"}
    assert all(math.isfinite(s) and s > 0 for s in snrs.values())
    assert len(switches) == 3 and policy.snr_step == 4


def test_adaptive_refuses_to_watch_parameters_without_gradients() -> None:
    """The tracker is bound, then the parameters are replaced under it: a clear error at the
    window's end, never a NaN SNR forever."""
    policy = build_policy(PrecisionConfig(mode="adaptive", snr_window=4), CPU)
    model, opt, _, _ = _train(policy, steps=3)  # bound on step 1
    _replace_parameters(model.blocks[1])
    opt = build_optimizer(model, OptimConfig(lr=1e-2), CPU)
    gen = torch.Generator().manual_seed(0)
    for step in range(4, 9):  # the window of steps 5-8 sees no gradient on block.1's old ones
        _forward_backward_step(policy, model, opt, gen)
        if step < 8:
            policy.after_step(step)
    with pytest.raises(RuntimeError, match=r"no gradient reached block\.1 in the window "
                                           r"ending at step 8"):
        policy.after_step(8)


def test_adaptive_needs_prepare() -> None:
    policy = build_policy(PrecisionConfig(mode="adaptive"), CPU)
    with pytest.raises(RuntimeError, match="prepare"):
        policy.unscale(torch.optim.SGD([nn.Parameter(torch.zeros(1))]))


# -- the default thresholds on the default job's gradients ---------------------------------

# Every step's gradient norm per layer group of the default job (TrainConfig() on the CPU, 2000
# steps) under adaptive precision at the default thresholds, with the SNRs and switches the
# live run made at each window's close: recorded by fixtures/record_adaptive_trace.py (its
# docstring says how to record it again, which a change of the defaults or of the default job
# calls for).
TRACE = Path(__file__).parent / "fixtures" / "adaptive_default_trace.json"
_ADAPTIVE_FIELDS = ("low", "snr_window", "snr_high", "snr_low", "min_dwell")


class _GroupNorms(nn.Module):
    """One 1-element weight per layer group of the default job, named and typed as its groups
    are: a replay sets each weight's gradient to the group's recorded norm."""

    def __init__(self, groups: list[str]) -> None:
        super().__init__()
        self.names = groups
        # the embedding a lookup, as the default job's is (adaptive pins it by its type)
        self.layers = nn.ModuleList(nn.Embedding(1, 1) if name == "embed"
                                    else nn.Linear(1, 1, bias=False) for name in groups)

    def layer_groups(self) -> dict[str, list[nn.Module]]:
        return {name: [layer] for name, layer in zip(self.names, self.layers, strict=True)}


_Moves = list[tuple[int, str, str, str]]  # (step, group, before, after)


def _replay(trace: dict[str, Any], cfg: PrecisionConfig
            ) -> tuple[AdaptivePolicy, _Moves, dict[int, dict[str, float]]]:
    """The recorded norms through AdaptivePolicy's per-step calls, as the loop makes them:
    the switches (step, group, before, after) and each window's SNRs."""
    model = _GroupNorms(trace["groups"])
    policy = build_policy(cfg, CPU)
    assert isinstance(policy, AdaptivePolicy)
    policy.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    switches: _Moves = []
    snrs: dict[int, dict[str, float]] = {}
    for step, norms in enumerate(trace["norms"], start=1):
        for layer, norm in zip(model.layers, norms, strict=True):
            layer.weight.grad = torch.full((1, 1), norm)
        policy.unscale(opt)  # the tracker records the step's gradients here
        policy.step(opt)
        opt.zero_grad(set_to_none=True)
        switches += [(step, s.group, s.before, s.after) for s in policy.after_step(step)]
        if step % cfg.snr_window == 0:
            snrs[step] = policy.last_snr()
    return policy, switches, snrs


@pytest.fixture(scope="module")
def trace() -> dict[str, Any]:
    return json.loads(TRACE.read_text())


def test_the_trace_was_recorded_at_todays_defaults(trace: dict[str, Any]) -> None:
    """The trace speaks for the default thresholds only while they are the recorded ones:
    after a change of the defaults, record it again (fixtures/record_adaptive_trace.py)."""
    defaults = PrecisionConfig(mode="adaptive")
    assert {f: trace["precision"][f] for f in _ADAPTIVE_FIELDS} == {
        f: getattr(defaults, f) for f in _ADAPTIVE_FIELDS}


def test_a_replay_of_the_default_job_decides_as_the_live_run_did(trace: dict[str, Any]) -> None:
    """The SNR of every window and every switch, recomputed from the recorded norms by the
    policy's own code, are the live run's."""
    cfg = PrecisionConfig.model_validate(trace["precision"])
    _, switches, snrs = _replay(trace, cfg)
    live = {w["step"]: w for w in trace["windows"]}
    assert sorted(snrs) == sorted(live)
    for step, window in live.items():
        assert snrs[step] == pytest.approx(window["snr"], rel=1e-4), step
    assert switches == [(w["step"], g, before, after) for w in trace["windows"]
                        for g, before, after in w["switches"]]



def _window_snr(norms: list[float]) -> float:
    return snr_from_moments(statistics.mean(norms), statistics.variance(norms), len(norms))


def test_default_thresholds_switch_the_default_job_as_the_policy_says(
        trace: dict[str, Any]) -> None:
    """At today's defaults, on the default job's real gradients: every block and the head drop
    to bf16 (each when its SNR rises above snr_high, none before min_dwell), a group whose
    SNR falls below snr_low returns to fp32, the late phase computes in bf16, and the pinned
    embedding stays fp32 though its own SNR rises as high."""
    cfg = PrecisionConfig(mode="adaptive")
    policy, switches, snrs = _replay(trace, cfg)
    measured = [g for g in trace["groups"] if g != "embed"]
    assert list(snrs[cfg.snr_window]) == measured  # the embedding is not measured
    for step, group, _, after in switches:
        snr = snrs[step][group]
        assert snr > cfg.snr_high if after == cfg.low else snr < cfg.snr_low, (step, group)
    drops = {g: min(s for s, gg, _, a in switches if gg == g and a == cfg.low)
             for g in measured if any(gg == g for _, gg, _, _ in switches)}
    assert set(drops) == set(measured), switches  # every measured group dropped ...
    assert min(drops.values()) >= cfg.min_dwell  # ... none before its first dwell ended
    assert {g for _, g, _, a in switches if a == "fp32"}  # and hysteresis let some return
    assert policy.modes() == {"embed": "fp32", **{g: cfg.low for g in measured}}
    # the late phase (after 60% of the run): every group in bf16 at every window's close
    modes, late = dict.fromkeys(measured, "fp32"), []
    steps = len(trace["norms"])
    for step in sorted(snrs):
        modes.update({g: after for s, g, _, after in switches if s == step})
        if step > 0.6 * steps:
            late.append(dict(modes))
    assert len(late) == 0.4 * steps // cfg.snr_window
    assert all(m == dict.fromkeys(measured, cfg.low) for m in late)
    # the embedding stays fp32 because it is pinned, not for want of a steady gradient
    embed = [row[0] for row in trace["norms"]]
    w = cfg.snr_window
    assert max(_window_snr(embed[s - w:s]) for s in range(w, steps + 1, w)) > cfg.snr_high
    assert all(g != "embed" for _, g, _, _ in switches)


def test_the_default_jobs_snr_separates_its_phases(trace: dict[str, Any]) -> None:
    """What precision.snr_from_moments' docstring says of the default job: each group's median
    SNR rises several-fold from the first 400 steps to the steps from 1200 on, across
    snr_high, and block.0 is the lowest early."""
    _, _, snrs = _replay(trace, PrecisionConfig.model_validate(trace["precision"]))
    groups = list(snrs[min(snrs)])
    early = {g: statistics.median(v[g] for s, v in snrs.items() if s <= 400) for g in groups}
    late = {g: statistics.median(v[g] for s, v in snrs.items() if s > 1200) for g in groups}
    assert all(late[g] > 2.5 * early[g] for g in groups), (early, late)
    assert all(late[g] > 2 * PrecisionConfig().snr_high for g in groups), late
    assert min(early, key=early.__getitem__) == "block.0", early

# -- checkpoints -----------------------------------------------------------------------------


def _through_disk(state: dict[str, object]) -> dict[str, object]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain values only: safe to load


def test_state_dict_round_trip_fp16() -> None:
    cfg = PrecisionConfig(mode="fp16", init_scale=1024.0)
    policy = build_policy(cfg, CPU)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.backward(model(torch.ones(1, 2)).sum())
    model.weight.grad.fill_(math.nan)  # type: ignore[union-attr]
    policy.step(opt)
    restored = build_policy(cfg, CPU)
    restored.load_state_dict(_through_disk(policy.state_dict()))
    assert (restored.skipped, restored.loss_scale) == (1, 512.0)


def test_state_dict_round_trip_adaptive() -> None:
    cfg = PrecisionConfig(mode="adaptive", low="fp16", snr_window=4, snr_low=1e-4,
                          snr_high=1e-3, min_dwell=0)
    policy = build_policy(cfg, CPU)
    _train(policy, steps=4)
    state = policy.state_dict()
    assert state["last_switch"] == {"block.0": 4, "block.1": 4, "head": 4}
    restored = build_policy(cfg, CPU)
    restored.prepare(GPT(MODEL))
    restored.load_state_dict(_through_disk(state))
    assert restored.modes() == policy.modes()
    assert restored.loss_scale == policy.loss_scale
    assert restored.state_dict() == state
    # another mode's checkpoint (an A/B arm switch) carries the counters and nothing else
    plain = build_policy(PrecisionConfig(mode="bf16"), CPU)
    plain.load_state_dict(state)
    assert plain.modes() == {"model": "bf16"}


# -- under FSDP: the tracker measures the sharded parameters -----------------------------------


@pytest.mark.slow
def test_adaptive_under_fsdp_measures_the_sharded_parameters(tmp_path: Path) -> None:
    """2 gloo ranks under FSDP2: ``fully_shard`` replaced the parameters after prepare(), so the
    tracker binds on the first step, sums the local shards' moments over the ranks, and
    reads the same SNR as one process over the whole batch (NaN forever before)."""
    from tests.trainer.test_parallel import config, run_ranks
    from traind.contracts.events import decode_complete
    from traind.trainer.config import TrainConfig
    from traind.trainer.loop import train
    from traind.trainer.sink import ListSink

    sections = {"precision": {"mode": "adaptive", "snr_window": 4, "snr_low": 0.01,
                              "snr_high": 0.1, "min_dwell": 0}}
    run_ranks(tmp_path / "two", config(tmp_path / "two", batch=4,
                                       parallel={"strategy": "fsdp"}, **sections))
    sink = ListSink()
    train(TrainConfig.model_validate(config(tmp_path / "one", batch=8, **sections)), sink)
    reference = [e for e in sink.events if isinstance(e, SNREvent)]
    per_rank = [[e for e in decode_complete((tmp_path / "two" / f"events.rank{r}").read_bytes())
                 if isinstance(e, SNREvent)] for r in (0, 1)]
    for events in per_rank:
        assert [e.step for e in events] == [e.step for e in reference] == list(range(4, 13))
        first = events[0]  # the window of steps 1-4: fp32 everywhere, the same data
        assert first.groups == ["block.0", "block.1", "head"]
        assert all(math.isfinite(s) and s > 0.1 for s in first.snr)
        assert first.snr == pytest.approx(reference[0].snr, rel=1e-3)
        assert first.modes == ["bf16"] * 3  # it switched at step 4 ...
        assert all(math.isfinite(s) for e in events for s in e.snr)  # ... and kept measuring
    assert [e.snr for e in per_rank[0]] == [e.snr for e in per_rank[1]]  # all-reduced alike
