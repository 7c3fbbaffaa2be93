"""Precision policies: the pure decisions by tables, the SNR math against a direct computation,
the fp16 scaler on CPU, and a tiny GPT trained under every mode this machine can run."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

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
    assert fp8_converts(fqn, k, n, recipe=recipe, emulated=emulated) is converts


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gpu_thresholds_are_torchaos(recipe: str) -> None:
    """Ours agree with torchao's own auto filter (the home of the measured thresholds) on a
    grid of shapes; ours is a pure function, so the table above can hold it."""
    from torchao.float8 import _auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, filter_fqns=["head"])
    for k, n in itertools.product((512, 1024, 1040, 2048, 4096, 4112, 8192), repeat=2):
        assert fp8_converts("blocks.0.x", k, n, recipe=recipe, emulated=False) == theirs(
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
                   for name in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down")}
    assert set(policy.converted) == fp8 and not isinstance(model.head, Float8Linear)
    layer = model.blocks[0].attn.qkv
    assert isinstance(layer, Float8Linear) and layer.config.emulate
    granularity = {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    assert layer.config.cast_config_weight.scaling_granularity.value == granularity
    # the same Parameters: the optimizer built after prepare() updates what the model uses
    assert dict(model.named_parameters()) == weights


def test_registry_covers_every_mode() -> None:
    modes = PrecisionConfig.model_fields["mode"].annotation.__args__  # type: ignore[union-attr]
    assert set(POLICIES) == set(modes)


@pytest.mark.parametrize(("signal", "noise", "expected"), [
    (4.0, 2.0, 2.0), (0.0, 1.0, 0.0), (1.0, 0.0, math.inf), (0.0, 0.0, math.nan),
])
def test_snr_from_moments(signal: float, noise: float, expected: float) -> None:
    got = snr_from_moments(signal, noise)
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


def _record(groups: dict[str, list[nn.Parameter]], grads: list[list[torch.Tensor]]) -> SNRTracker:
    tracker = SNRTracker(groups)
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
    # a mean that differs per element plus noise of another size per parameter
    seq = [[torch.full(p.shape, 0.3) + s * torch.randn(p.shape, generator=gen)
            for p, s in ((a, 0.5), (b, 0.1), (c, 2.0))] for _ in range(7)]
    got = _record(groups, seq).snr()
    stacked = [torch.stack([step[i] for step in seq]).double() for i in range(3)]  # (n, ...)

    def direct(idx: list[int]) -> float:
        signal = sum(stacked[i].mean(0).square().sum() for i in idx)
        noise = sum(stacked[i].var(0, unbiased=True).sum() for i in idx)
        return float(signal / noise)

    assert got["g0"] == pytest.approx(direct([0, 1]), rel=1e-4)
    assert got["g1"] == pytest.approx(direct([2]), rel=1e-4)


def test_snr_by_hand() -> None:
    p = nn.Parameter(torch.zeros(2))
    # grads (1,0), (3,0): mean (2,0) -> signal 4; sample variance (2,0) -> noise 2; SNR 2
    tracker = _record({"g": [p]}, [[torch.tensor([1.0, 0.0])], [torch.tensor([3.0, 0.0])]])
    assert tracker.snr()["g"] == pytest.approx(2.0)
    tracker.reset()
    assert tracker.count == 0
    assert math.isnan(tracker.snr()["g"])  # fewer than 2 steps: no estimate


def test_snr_constant_gradient_is_infinite() -> None:
    p = nn.Parameter(torch.zeros(10))
    tracker = _record({"g": [p]}, [[torch.linspace(-1, 1, 10)]] * 8)
    assert tracker.snr()["g"] == math.inf


def test_snr_zero_mean_noise_is_about_one_over_window() -> None:
    gen = torch.Generator().manual_seed(1)
    p = nn.Parameter(torch.zeros(4000))
    window = 16
    tracker = _record({"g": [p]}, [[torch.randn(4000, generator=gen)] for _ in range(window)])
    # E||mean||^2 = D/n, E sum var = D: SNR ~ 1/n, here within a few percent (D = 4000)
    assert tracker.snr()["g"] == pytest.approx(1 / window, rel=0.15)


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
    for name, mod in (("qkv", model.blocks[0].attn.qkv), ("head", model.head),
                      ("emb", model.tok_emb)):
        mod.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    with policy.autocast():
        model(*_batch(torch.Generator().manual_seed(1)))
    assert seen == {"qkv": dtype, "head": dtype, "emb": torch.float32}
    assert not torch.is_autocast_enabled("cpu")  # every block's context was left
    _assert_fp32_master(model, opt)

    policy.close()  # hooks gone: the model computes in fp32 again
    seen.clear()
    model(*_batch(torch.Generator().manual_seed(1)))
    assert seen == {"qkv": torch.float32, "head": torch.float32, "emb": torch.float32}


def test_adaptive_fp32_block_ignores_an_outer_autocast() -> None:
    policy = build_policy(PrecisionConfig(mode="adaptive"), CPU)
    model = policy.prepare(GPT(MODEL))
    seen: list[torch.dtype] = []
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
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


def test_adaptive_needs_prepare() -> None:
    policy = build_policy(PrecisionConfig(mode="adaptive"), CPU)
    with pytest.raises(RuntimeError, match="prepare"):
        policy.unscale(torch.optim.SGD([nn.Parameter(torch.zeros(1))]))


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
