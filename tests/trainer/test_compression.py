"""Gradient compression: the pure math (property tests), then real 2-rank gloo DDP runs, then
the bytes each method hands torch.distributed (4 real gloo ranks; 8 and 16 with the group
faked).

The multi-rank tests fork two ranks (no CUDA here, so fork is safe and skips re-importing
torch, which costs ~10 s per spawned rank on 2 cores) that meet through a FileStore.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from traind.contracts.events import CommEvent
from traind.trainer.compression import (
    METHODS,
    WIRE_BYTES,
    CommStats,
    CompressionHook,
    allgather_wire_bytes,
    allreduce_wire_bytes,
    alltoall_wire_bytes,
    dequantize_int8,
    error_feedback,
    quantize_int8,
    topk_compress,
    topk_count,
    topk_decompress,
)
from traind.trainer.compression._powersgd import PowerSGD
from traind.trainer.config import CompressionConfig, DataConfig, ModelConfig
from traind.trainer.data import BatchSampler, build_corpus, split_corpus
from traind.trainer.model import GPT

if typing.TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


def _gradient(n: int, seed: int, spread: float) -> torch.Tensor:
    """Gaussian values with per-element magnitudes spread over ``spread`` decades: real
    gradients mix tiny and large entries, which is what blockwise scales are for."""
    gen = torch.Generator().manual_seed(seed)
    mags = 10 ** (spread * torch.rand(n, generator=gen))
    return torch.randn(n, generator=gen) * mags * 1e-3


# ---------------------------------------------------------------- pure functions

@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), block=st.sampled_from([1, 7, 64, 256]), seed=st.integers(0, 99),
       spread=st.floats(0, 4))
def test_int8_round_trip_error_is_at_most_half_a_step(n: int, block: int, seed: int,
                                                      spread: float) -> None:
    x = _gradient(n, seed, spread)
    q, scales = quantize_int8(x, block)
    assert q.dtype == torch.int8 and q.shape == (n,)
    assert scales.shape == (math.ceil(n / block),)
    err = (dequantize_int8(q, scales, block) - x).abs()
    per_element_scale = scales.repeat_interleave(block)[:n]
    # scale/2 from rounding, plus float32's own rounding of x / scale and q * scale
    assert bool((err <= per_element_scale * (0.5 + 1e-5) + 1e-12).all())


def test_int8_zero_block_and_extremes() -> None:
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -3.0, 1.5, 3.0, 0.0])
    q, scales = quantize_int8(x, 4)
    assert q[:4].tolist() == [0, 0, 0, 0] and scales[0] == 0
    assert q[4:].tolist() == [-127, 64, 127, 0]  # 1.5 / (3/127) = 63.5 -> 64 (half to even)
    assert torch.equal(dequantize_int8(q, scales, 4)[:4], torch.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        quantize_int8(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="scales do not fit"):
        dequantize_int8(q, scales[:1], 4)


@pytest.mark.parametrize(("n", "ratio", "k"), [
    (300, 0.01, 3),  # not 4: 0.01 is stored a hair above 1/100
    (1000, 0.001, 1), (10, 0.25, 3), (5, 1.0, 5), (7, 0.01, 1), (0, 0.5, 0), (100, 0.1, 10),
])
def test_topk_count_table(n: int, ratio: float, k: int) -> None:
    assert topk_count(n, ratio) == k


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 99))
def test_topk_keeps_exactly_k_largest(n: int, ratio: float, seed: int) -> None:
    x = _gradient(n, seed, 3)
    values, indices = topk_compress(x, ratio)
    k = topk_count(n, ratio)
    assert k == min(n, max(1, math.ceil(ratio * n - 1e-6)))
    assert values.shape == (k,) and indices.dtype == torch.int32
    assert len(set(indices.tolist())) == k
    dense = topk_decompress(values, indices, n)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[indices.long()] = True
    assert torch.equal(dense[kept], x[kept]) and bool((dense[~kept] == 0).all())
    if k < n:  # nothing dropped is larger than anything kept
        assert x[~kept].abs().max() <= x[kept].abs().min()


def test_topk_decompress_adds_where_ranks_overlap() -> None:
    out = topk_decompress(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3, 0, 3],
                          dtype=torch.int32), 5)
    assert out.tolist() == [2.0, 0.0, 0.0, 5.0, 0.0]


def _int8_codec(block: int) -> tuple[Callable[..., Any], Callable[..., Any], float]:
    # |r_i| <= scale/2 = absmax_block(x)/254 and absmax_block² <= ||x_block||², so
    # ||r|| <= c ||x|| with c = sqrt(block)/254; with x = g + r_prev that gives
    # ||r|| <= c/(1-c) · max ||g||.
    c = math.sqrt(block) / 254
    return (lambda x: quantize_int8(x, block), lambda p: dequantize_int8(*p, block),
            c / (1 - c))


def _topk_codec(n: int, ratio: float) -> tuple[Callable[..., Any], Callable[..., Any], float]:
    # top-k keeps at least k/n of ||x||², so ||r|| <= g ||x|| with g = sqrt(1 - k/n), and
    # ||r|| <= g/(1-g) · max ||g|| (the contraction bound of Stich et al. 2018).
    gamma = math.sqrt(1 - topk_count(n, ratio) / n)
    return (lambda x: topk_compress(x, ratio), lambda p: topk_decompress(*p, n),
            gamma / (1 - gamma) if gamma < 1 else 0.0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), steps=st.integers(1, 30), seed=st.integers(0, 99),
       method=st.sampled_from(["int8", "topk"]), block=st.sampled_from([16, 256]),
       ratio=st.sampled_from([0.01, 0.1, 0.5]), drift=st.floats(0, 1))
def test_error_feedback_loses_nothing_over_time(n: int, steps: int, seed: int, method: str,
                                                block: int, ratio: float,
                                                drift: float) -> None:
    """sum(sent_t) + residual_n == sum(g_t), and the residual stays within C·max||g_t||."""
    compress, decompress, bound = (_int8_codec(block) if method == "int8"
                                   else _topk_codec(n, ratio))
    mean = _gradient(n, seed + 1000, 2) * drift  # a shared direction, as real gradients have
    residual: torch.Tensor | None = None
    sent_sum = torch.zeros(n, dtype=torch.float64)
    g_sum = torch.zeros(n, dtype=torch.float64)
    g_max = 0.0
    for t in range(steps):
        g = mean + _gradient(n, seed * 100 + t, 2)
        fb = error_feedback(g, residual, compress, decompress)
        residual = fb.residual
        sent_sum += fb.x_hat.double()
        g_sum += g.double()
        g_max = max(g_max, float(g.norm()))
        assert float(residual.norm()) <= bound * g_max * (1 + 1e-5) + 1e-12
    assert residual is not None
    scale = float(g_sum.abs().max()) + g_max
    assert torch.allclose(sent_sum + residual.double(), g_sum, rtol=0, atol=1e-5 * scale)


def test_error_feedback_zeroes_non_finite_residual() -> None:
    g = torch.tensor([float("inf"), 1.0, float("nan"), 0.25])
    fb = error_feedback(g, None, lambda x: quantize_int8(x, 2), lambda p: dequantize_int8(*p, 2))
    assert bool(torch.isfinite(fb.residual).all())
    assert not bool(torch.isfinite(fb.x_hat).all())  # sent as is: the fp16 scaler must see it


@pytest.mark.parametrize(("payload", "world", "ar", "ag", "a2a"), [
    (1000, 1, 0, 0, 0), (1000, 2, 1000, 1000, 500), (1000, 4, 1500, 3000, 750),
    (800, 8, 1400, 5600, 700),
])
def test_ring_wire_bytes(payload: int, world: int, ar: int, ag: int, a2a: int) -> None:
    assert allreduce_wire_bytes(payload, world) == ar == WIRE_BYTES["all_reduce"](payload, world)
    assert allgather_wire_bytes(payload, world) == ag == WIRE_BYTES["all_gather"](payload, world)
    assert alltoall_wire_bytes(payload, world) == a2a == WIRE_BYTES["all_to_all"](payload,
                                                                                  world)


def test_methods_match_the_config_and_stats_match_the_event() -> None:
    literal = typing.get_args(CompressionConfig.model_fields["method"].annotation)
    assert set(METHODS) == set(literal)
    # The loop adds the rest: who and when, DDP's own timing, the group's size, and the mesh
    # dimension (the hook's collectives are dp's: the event's default).
    event_fields = {f.name for f in dataclasses.fields(CommEvent)} - {
        "rank", "step", "method", "time", "ddp", "world_size", "mesh_dim"}
    assert {f.name for f in dataclasses.fields(CommStats)} == event_fields


def test_set_method_rejects_bad_values_with_the_field() -> None:
    hook = CompressionHook(CompressionConfig())  # needs no process group until a bucket comes
    with pytest.raises(ValueError, match=r"compression\.method"):
        hook.set_method("zip")
    with pytest.raises(ValueError, match="topk_ratio"):
        hook.set_method("topk", topk_ratio=2.0)
    with pytest.raises(ValueError, match="int8_blok"):  # a typo is an unknown field
        hook.set_method("int8", int8_blok=64)
    hook.set_method("topk", topk_ratio=0.05)
    assert hook.method == "topk" and hook.cfg.topk_ratio == 0.05
    assert hook.take_stats() == CommStats()


# ---------------------------------------------------------------- 2 real gloo ranks

WORLD = 2


def _rank_main(rank: int, fn: Callable[..., None], store: str, args: tuple[Any, ...],
               world: int) -> None:
    torch.set_num_threads(1)  # 2 cores, 2 ranks
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, fn: Callable[..., None], *args: Any, world: int = WORLD) -> None:
    """Run ``fn(rank, *args)`` on ``world`` forked gloo ranks; a rank's exception fails the
    test.

    Fork, not spawn: nothing here has touched CUDA, and a spawned rank re-imports torch."""
    mp.start_processes(_rank_main, args=(fn, str(tmp_path / "store"), args, world),
                       nprocs=world, start_method="fork")


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 8))


def _ddp(model: nn.Module, cfg: CompressionConfig, **hook_kw: Any) -> tuple[DDP,
                                                                            CompressionHook]:
    # ~10 kB buckets: the 5768-parameter model spreads over several, as a real one would
    ddp = DDP(model, bucket_cap_mb=0.01)
    hook = CompressionHook(cfg, **hook_kw)
    hook.register(ddp)
    return ddp, hook


def _grads_and_exact_average(ddp: DDP, replica: nn.Module, step: int,
                             rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hook's gradient after one backward, and the exact average computed without it."""
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    x = torch.randn(32, 16, generator=gen)
    ddp.zero_grad()
    ddp(x).square().mean().backward()
    got = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
    replica.zero_grad()
    replica(x).square().mean().backward()
    exact = torch.cat([p.grad.reshape(-1) for p in replica.parameters()])  # type: ignore[union-attr]
    dist.all_reduce(exact)
    return got, exact / dist.get_world_size()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _ratio(s: CommStats) -> float:
    return s.raw_bytes / s.sent_bytes


# method -> (max relative error of the averaged gradient against the exact one,
#            (low, high) for raw/sent at 2 ranks, (low, high) for the local rel_error)
EXPECT: dict[str, tuple[float, tuple[float, float], tuple[float, float]]] = {
    "none": (1e-6, (1.0, 1.0), (0.0, 0.0)),
    "fp16": (1e-3, (2.0, 2.0), (1e-5, 1e-3)),
    "bf16": (1e-2, (2.0, 2.0), (1e-4, 1e-2)),
    # 4 n / (n + 4 ceil(n/256)): 3.94 for long buckets, a bit less with padding. Two
    # roundings (the rank's, then its shard average's, each fed back), and with feedback the
    # applied gradient also carries the last step's residual: ~sqrt(2) x one rounding.
    "int8": (0.03, (3.8, 4 / (1 + 4 / 256) + 1e-9), (1e-3, 0.03)),
    # 4 n / (8 ceil(0.01 n)) -> 1/(2·0.01) = 50 for long buckets, less where ceil rounds up
    "topk": (1.0, (40.0, 50.0), (0.5, 1.0)),
}


def _check_each_method(rank: int, debug_wait: bool) -> None:
    steps = 3
    for method, (max_err, (lo, hi), (err_lo, err_hi)) in EXPECT.items():
        model = _mlp()
        replica = _mlp()
        ddp, hook = _ddp(model, CompressionConfig(method=method, debug_wait=debug_wait))
        for step in range(steps):
            got, exact = _grads_and_exact_average(ddp, replica, step, rank)
            if step == 0 or method != "topk":  # topk with feedback drifts by design
                assert _rel(got, exact) <= max_err, (method, step, _rel(got, exact))
            if method == "none":
                torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-9)
        stats = hook.take_stats()
        assert stats.steps == steps, (method, stats)
        # DDP's first iteration uses one bucket, then rebuilds them (here into 2) by the order
        # gradients became ready: the residual store must survive that
        assert stats.buckets > steps, stats
        assert stats.raw_bytes == steps * 4 * sum(p.numel() for p in model.parameters())
        assert lo <= _ratio(stats) <= hi, (method, _ratio(stats))
        assert err_lo <= stats.rel_error <= err_hi, (method, stats.rel_error)
        assert stats.hook_seconds > 0 and stats.allreduce_seconds > 0, stats
        assert hook.take_stats() == CommStats()  # taking resets the window


@pytest.mark.parametrize("debug_wait", [False, True], ids=["async", "debug_wait"])
def test_each_method_against_the_exact_average(tmp_path: Path, debug_wait: bool) -> None:
    """none is exact, the casts are close, int8 is close, every ratio is what the bytes say;
    on the one asynchronous path and with the debug option that waits inside backward."""
    run_ranks(tmp_path, _check_each_method, debug_wait)


def _check_switching(rank: int) -> None:
    model, replica = _mlp(), _mlp()
    cfg = CompressionConfig(method="none", powersgd_start_step=2, powersgd_rank=2)
    ddp, hook = _ddp(model, cfg)
    plan: list[tuple[str, dict[str, Any], int]] = [
        ("none", {}, 2), ("fp16", {}, 2), ("int8", {"int8_block": 64}, 2),
        ("topk", {"topk_ratio": 0.1}, 2), ("powersgd", {}, 3), ("none", {}, 2)]
    step = 0
    for method, params, n in plan:
        hook.set_method(method, **params)
        for _ in range(n):
            got, exact = _grads_and_exact_average(ddp, replica, step, rank)
            step += 1
        stats = hook.take_stats()
        assert stats.steps == n and hook.steps_done == step
        if method == "none":  # after topk and powersgd: nothing of theirs leaks into none
            torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-9)
            assert _ratio(stats) == 1.0 and stats.rel_error == 0.0
        elif method == "int8":
            assert 3.5 < _ratio(stats) < 4 / (1 + 4 / 64)  # block 64: 4 scale bytes per 64
        elif method == "topk":
            assert 4.0 < _ratio(stats) <= 5.0  # 1 / (2 · 0.1)
            assert len(hook.compressor.residuals) == stats.buckets // n
        elif method == "powersgd":
            # warm-up counts training steps (it is step 8 now), so it compresses at once:
            # the 64x64 and 64x16 matrices go as rank-2 factors, the biases as they are
            assert _ratio(stats) > 3.0, _ratio(stats)
            assert 0 < stats.rel_error < 1.5
    assert stats.buckets > 0


def test_switch_methods_in_one_ddp_model(tmp_path: Path) -> None:
    run_ranks(tmp_path, _check_switching)


# Training: a tiny GPT on real text (the standard library's source), every method from the
# same weights and data order, 40 AdamW steps.
TRAIN_STEPS = 40
# none goes from ln(256) = 5.5 to ~2.8 in 40 steps. The margin, 0.2, is ~7% of that drop:
# flipping none to fp16 alone moves the result by ~0.03 (a bit-level change sends the
# trajectory elsewhere), topk at 1% honestly lags by ~0.13, and a gradient that is scrambled
# (a wrong index or byte view) does not learn at all (> 3.5). The exactness of each method
# is the other tests' job: under AdamW, which divides by the gradient's own scale, a loss
# comparison cannot see a wrong 1/N factor.
LOSS_MARGIN = 0.2


def _train(rank: int, method: str, train_data: torch.Tensor, val: list[tuple[torch.Tensor,
           torch.Tensor]]) -> float:
    torch.manual_seed(0)
    model = GPT(ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32))
    ddp = DDP(model, bucket_cap_mb=0.05)
    # topk at its default 1% is slow by design at 40 steps (error feedback pays the rest back
    # over many more): 10% keeps this a test of each method's averaging, not of its pace.
    CompressionHook(CompressionConfig(method=method, powersgd_start_step=5,
                                      topk_ratio=0.1)).register(ddp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    sampler = BatchSampler(train_data, batch_size=4, seq_len=32, seed=0, rank=rank,
                           world_size=WORLD)
    for _ in range(TRAIN_STEPS):
        x, y = sampler.next()
        _, loss = ddp(x, y)
        opt.zero_grad()
        assert loss is not None
        loss.backward()
        opt.step()
    with torch.no_grad():
        return sum(float(model(x, y)[1]) for x, y in val) / len(val)


def _check_training(rank: int, out: str) -> None:
    corpus = build_corpus(DataConfig(max_bytes=100_000))
    train_data, val_data = split_corpus(corpus, 0.05, seq_len=32)
    val = [(val_data[i: i + 32].long()[None], val_data[i + 1: i + 33].long()[None])
           for i in range(0, 32 * 8, 32)]
    losses = {m: _train(rank, m, train_data, val) for m in METHODS}
    if rank == 0:
        torch.save(losses, out)


def test_every_method_trains_close_to_none(tmp_path: Path) -> None:
    out = tmp_path / "losses.pt"
    run_ranks(tmp_path, _check_training, str(out))
    losses: dict[str, float] = torch.load(out)
    print({m: round(v, 3) for m, v in losses.items()})
    assert losses["none"] < 3.5  # it learned: from ln(256) = 5.5
    for method, loss in losses.items():
        assert loss - losses["none"] < LOSS_MARGIN, (method, losses)


def test_residuals_survive_a_checkpoint_by_parameter_name() -> None:
    """Saved by name, restored into a bucket whose parameters come in another order."""
    from traind.trainer.compression import Residuals

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))

    class Bucket:
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            self._params = params
            self._buf = torch.zeros(sum(p.numel() for p in params))

        def index(self) -> int:
            return 0

        def buffer(self) -> torch.Tensor:
            return self._buf

        def parameters(self) -> list[torch.nn.Parameter]:
            return self._params

    saved = Residuals()
    saved.put(Bucket([a, b]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))  # type: ignore[arg-type]
    state = saved.state_dict({id(a): "a", id(b): "b"})
    assert state["a"].tolist() == [1, 2, 3] and state["b"].tolist() == [4, 5]

    a2, b2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    restored = Residuals()
    restored.load_state_dict(state, {id(a2): "a", id(b2): "b"})
    got = restored.get(Bucket([b2, a2]))  # type: ignore[arg-type]
    assert got is not None and got.tolist() == [4, 5, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), world=st.sampled_from([1, 2, 3, 8]),
       block=st.sampled_from([1, 7, 64, 256]), seed=st.integers(0, 99))
def test_int8_shard_rows_round_trip(n: int, world: int, block: int, seed: int) -> None:
    """Quantizing in the shards' block-aligned layout, packing a row per rank and unpacking
    gives each element's own dequantized value back, and nothing of the padding."""
    from traind.trainer.compression._math import (
        pack_int8_rows,
        shard_len,
        shard_rows,
        unpack_int8_rows,
        unshard_rows,
    )

    x = _gradient(n, seed, 3)
    shard = shard_len(n, world)
    assert world * shard < n + world
    width = -(-shard // block) * block
    laid = shard_rows(x, world, shard, width)
    assert laid.shape == (world, width) and torch.equal(unshard_rows(laid, shard, n), x)
    q, scales = quantize_int8(laid.reshape(-1), block)
    rows = pack_int8_rows(q, scales, world, shard, block)
    assert rows.shape == (world, 4 * (width // block) + shard) and rows.dtype == torch.uint8
    want = unshard_rows(dequantize_int8(q, scales, block).view(world, width), shard, n)
    assert torch.equal(unpack_int8_rows(rows, shard, block)[:n], want)
    # no block straddles two shards: each row's blocks see only that row's values
    for r in range(world):
        _, s_r = quantize_int8(laid[r], block)
        assert torch.equal(s_r, scales.view(world, -1)[r])


def test_size_buckets_and_latency_bins_follow_their_bounds() -> None:
    from traind.contracts.comm import LATENCY_BOUNDS, latency_bin, size_bucket

    assert [size_bucket(n) for n in (1, 4096, 4097, 2**20, 2**26, 2**26 + 1)] == [
        "4KiB", "4KiB", "64KiB", "1MiB", "64MiB", "inf"]
    assert latency_bin(LATENCY_BOUNDS[0]) == 0  # "le": the bound belongs to its bucket
    assert latency_bin(1e9) == len(LATENCY_BOUNDS)  # +Inf


def test_ddp_timing_reads_nanoseconds_and_waits_for_a_sample() -> None:
    from traind.trainer.parallel import ddp_timing

    assert ddp_timing({"world_size": 2}) == {}
    got = ddp_timing({"forward_compute_time": 1_000_000, "backward_compute_time": 3_000_000,
                      "backward_comm_time": 2_000_000,
                      "backward_compute_comm_overlap_time": 500_000})
    assert got == {"forward_compute": 1e-3, "backward_compute": 3e-3, "backward_comm": 2e-3,
                   "backward_overlap": 5e-4}


# ---------------------------------------------------------------- the one asynchronous path


def _residual(hook: CompressionHook, ddp: DDP) -> torch.Tensor:
    """This rank's residual in parameter order (zeros where a bucket has none)."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    c = hook.compressor  # PowerSGD keeps its error out of checkpoints: read it directly
    state = c.error.state_dict(names) if isinstance(c, PowerSGD) else c.state_dict(names)
    return torch.cat([state.get(n, torch.zeros(p.numel())).reshape(-1)
                      for n, p in ddp.module.named_parameters()])


def _check_two_phase_telescopes(rank: int, method: str) -> None:
    model, replica = _mlp(), _mlp()
    ddp, hook = _ddp(model, CompressionConfig(method="none"))
    _grads_and_exact_average(ddp, replica, 0, rank)  # DDP rebuilds its buckets after this one
    hook.take_stats()
    hook.set_method(method, topk_ratio=0.1)  # from here on: the same buckets, residuals at 0
    applied = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    exact_sum = torch.zeros_like(applied)
    for step in range(1, 6):
        got, exact = _grads_and_exact_average(ddp, replica, step, rank)
        applied += got.double()
        exact_sum += exact.double()
    stats = hook.take_stats()
    world = dist.get_world_size()
    ops: dict[str, int] = {}
    for c in stats.collectives:
        ops[c["op"]] = ops.get(c["op"], 0) + c["calls"]
    assert ops == {"all_to_all": stats.buckets, "all_gather": stats.buckets}, ops
    mean_residual = _residual(hook, ddp)
    assert float(mean_residual.norm()) > 0  # something was carried
    dist.all_reduce(mean_residual)
    mean_residual /= world
    # sum of applied gradients + mean residual == sum of exact averages: nothing is lost,
    # including the second phase's error that the shard owners carry
    torch.testing.assert_close(applied + mean_residual.double(), exact_sum, rtol=0,
                               atol=1e-5 * float(exact_sum.abs().max()))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("method", ["int8", "topk"])
def test_two_phase_methods_lose_nothing_across_ranks(tmp_path: Path, method: str,
                                                     world: int) -> None:
    """3 ranks: shards of unequal real length (padding) and a third owner."""
    run_ranks(tmp_path, _check_two_phase_telescopes, method, world=world)


class _Spy:
    """A DDP hook state around the real hook: counts buckets whose future DDP got while
    their collectives were still running (backward then computes on while they finish)."""

    def __init__(self, hook: CompressionHook) -> None:
        self.hook, self.in_flight, self.buckets = hook, 0, 0

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = self.hook(bucket)
        self.buckets += 1
        self.in_flight += not fut.done()
        return fut


def _check_overlap(rank: int, debug_wait: bool, out: str) -> None:
    from traind.trainer.compression import comm_hook
    from traind.trainer.parallel import ddp_timing

    # a wider MLP than _mlp: collectives long enough to see in flight on a loaded machine
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    ddp = DDP(model, bucket_cap_mb=0.1)
    hook = CompressionHook(CompressionConfig(method="int8", debug_wait=debug_wait))
    spy = _Spy(hook)
    ddp.register_comm_hook(spy, comm_hook)  # type: ignore[arg-type]
    steps = 6
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, 64, generator=gen)
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    stats = hook.take_stats()
    assert stats.steps == steps and spy.buckets == stats.buckets
    timing = ddp_timing(ddp._get_ddp_logging_data())
    if rank == 0:
        torch.save({"in_flight": spy.in_flight, "buckets": spy.buckets, "timing": timing,
                    "busy": stats.allreduce_seconds}, out)


@pytest.mark.parametrize("debug_wait", [False, True], ids=["async", "debug_wait"])
def test_backward_overlaps_communication_on_gloo(tmp_path: Path, debug_wait: bool) -> None:
    """The CPU path is the GPU's: DDP gets each bucket's future while its collectives are in
    flight, and DDP's own figure (traind_ddp_overlap_ratio) sees the overlap. With the debug
    option every bucket is finished inside backward."""
    out = tmp_path / "overlap.pt"
    run_ranks(tmp_path, _check_overlap, debug_wait, str(out))
    got = torch.load(out)
    print(got)
    if debug_wait:
        assert got["in_flight"] == 0
    else:
        assert got["in_flight"] > got["buckets"] // 2, got
        assert got["timing"]["backward_overlap"] > 0, got


def _check_true_units(rank: int, method: str) -> None:
    """Two models from the same weights and data: one unscaled, one whose loss is multiplied
    by a scale that changes every step, as an fp16 GradScaler's does. With residuals in true
    units both carry the same residual, and the scaled one's gradient is the other's times
    the scale; kept in scaled units, a residual made at 1024 and spent at 256 would be 4x
    too large."""
    cfg = CompressionConfig(method=method, topk_ratio=0.1, powersgd_start_step=2)
    ddp_a, hook_a = _ddp(_mlp(), cfg)
    ddp_b, hook_b = _ddp(_mlp(), cfg)
    scale = torch.tensor(1.0)  # 0-dim, updated in place like GradScaler._scale
    hook_b.loss_scale = lambda: scale
    for step, s in enumerate([1.0, 1.0, 1024.0, 256.0, 2.0**14, 8.0]):
        scale.fill_(s)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=gen)
        grads = []
        for ddp, factor in ((ddp_a, 1.0), (ddp_b, s)):
            ddp.zero_grad()
            (ddp(x).square().mean() * factor).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]))
        # int8/topk are exact under power-of-two scales; PowerSGD's orthogonalisation adds an
        # epsilon to column norms, which does not scale: a hair, far below a 4x misweighting
        tol = ({"rtol": 1e-3, "atol": 1e-5 * float(grads[0].abs().max())}
               if method == "powersgd" else {"rtol": 1e-6, "atol": 1e-12})
        torch.testing.assert_close(grads[1] / s, grads[0], **tol)
        # the carried residual, read back in true units, is the unscaled run's
        torch.testing.assert_close(_residual(hook_b, ddp_b), _residual(hook_a, ddp_a), **tol)
    assert float(_residual(hook_a, ddp_a).norm()) > 0


@pytest.mark.parametrize("method", ["int8", "topk", "powersgd"])
def test_residuals_are_kept_in_true_units_when_the_loss_scale_changes(tmp_path: Path,
                                                                      method: str) -> None:
    run_ranks(tmp_path, _check_true_units, method)


def _check_powersgd_counts(rank: int) -> None:
    model, replica = _mlp(), _mlp()
    ddp, hook = _ddp(model, CompressionConfig(method="powersgd", powersgd_start_step=2))
    for step in range(3):  # 0, 1: plain all-reduce (one per bucket); 2: compressed
        _grads_and_exact_average(ddp, replica, step, rank)
        stats = hook.take_stats()
        calls = sum(c["calls"] for c in stats.collectives)
        assert {c["op"] for c in stats.collectives} == {"all_reduce"}
        # every bucket of this MLP holds a weight matrix and its bias: vectors, P and Q
        assert calls == stats.buckets * (3 if step == 2 else 1), (step, calls, stats.buckets)
        # at 2 ranks a ring all-reduce sends its message once: the bytes agree exactly
        assert sum(c["bytes"] for c in stats.collectives) == stats.sent_bytes
        assert stats.allreduce_seconds > 0


def test_powersgd_counts_its_vector_p_and_q_all_reduces(tmp_path: Path) -> None:
    run_ranks(tmp_path, _check_powersgd_counts)


class _WallEvent:
    """``torch.cuda.Event`` on a CPU machine: ``record`` stamps the host's clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = 0.0

    def record(self) -> None:
        import time

        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _WallEvent) -> float:
        return (end.at - self.at) * 1000.0


def _check_event_clock(rank: int) -> None:
    from traind.trainer.collectives import EventClock

    torch.cuda.Event = _WallEvent  # type: ignore[assignment,misc]  # a forked rank: no undo
    model, replica = _mlp(), _mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)
    hook = CompressionHook(CompressionConfig(method="int8"), clock=EventClock())
    hook.register(ddp)
    for step in range(3):
        _grads_and_exact_average(ddp, replica, step, rank)
    stats = hook.take_stats()
    assert sum(c["calls"] for c in stats.collectives) == 2 * stats.buckets
    per_call = sum(c["seconds"] for c in stats.collectives)
    # real seconds from the event pairs (no longer 0 on CUDA), and their union at most the sum
    assert 0 < stats.allreduce_seconds <= per_call + 1e-9, stats


def test_the_event_clock_times_the_hooks_collectives(tmp_path: Path) -> None:
    """The CUDA branch of the hook's timing, on gloo: events stand in for the stream's."""
    run_ranks(tmp_path, _check_event_clock)


def test_the_precision_policy_hands_the_hook_the_live_scale_tensor() -> None:
    """What the loop sets as ``hook.loss_scale``: the GradScaler's own 0-dim tensor (no host
    read), None without a scaler; the scaler's update is seen through the same object."""
    from traind.trainer.config import PrecisionConfig
    from traind.trainer.precision import build_policy

    cpu = torch.device("cpu")
    assert build_policy(PrecisionConfig(mode="fp32"), cpu).scale_tensor() is None
    policy = build_policy(PrecisionConfig(mode="fp16"), cpu)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.backward(model(torch.ones(2, 4)).sum())
    scale = policy.scale_tensor()
    assert scale is not None and scale.dim() == 0 and float(scale) == policy.loss_scale
    model.weight.grad.fill_(float("inf"))  # type: ignore[union-attr]  # an overflow: halves
    before = float(scale)
    policy.step(opt)
    assert policy.scale_tensor() is scale and float(scale) == before / 2


def test_a_resume_keeps_the_configured_method_not_the_checkpoints() -> None:
    """A forked trial of a compression arm resumes from a checkpoint written without
    compression: it must train with its own method (it took the checkpoint's ``none``)."""
    from traind.trainer.compression import CompressionHook

    topk = CompressionConfig(method="topk", topk_ratio=0.01, error_feedback=False)
    hook = CompressionHook(topk)
    hook.load_state_dict({"method": "none", "cfg": CompressionConfig().model_dump(),
                          "residuals": {}})
    assert hook.method == "topk" and hook.cfg == topk
    # same method, other settings: the configuration's settings stay
    hook.load_state_dict({"method": "topk", "residuals": {},
                          "cfg": topk.model_copy(update={"topk_ratio": 0.5}).model_dump()})
    assert hook.cfg.topk_ratio == 0.01


def _check_untimed(rank: int) -> None:
    model, replica = _mlp(), _mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)
    hook = CompressionHook(CompressionConfig(method="none"), timed=False)
    hook.register(ddp)
    for step in range(2):
        got, exact = _grads_and_exact_average(ddp, replica, step, rank)
        torch.testing.assert_close(got, exact)
    stats = hook.take_stats()
    assert stats.buckets > 0 and stats.sent_bytes > 0  # the hook's own counts stay
    assert stats.collectives == () and stats.allreduce_seconds == 0.0


def test_telemetry_collectives_off_times_nothing_and_averages_the_same(tmp_path: Path) -> None:
    """``telemetry.collectives = false`` (the bare arm of bench/overhead.py --ranks)."""
    run_ranks(tmp_path, _check_untimed)


# ------------------------------------------------- the bytes handed to torch.distributed
#
# The hook counts its bytes in its Channel, from the tensors it means to send. These tests
# count them where they leave traind: every call into torch.distributed's collectives is
# wrapped and the size of what the rank hands in recorded, so a method that sends fp32 where
# it claims int8, sends a bucket twice, or issues a collective outside its Channel is caught
# by what torch.distributed saw, not by what the hook says it did.

# torch.distributed's tensor collectives and point-to-point calls -> the parameter holding
# what this rank hands in (a receive's is the buffer it receives into)
_HANDED_ARG = {
    "all_reduce": "tensor", "all_reduce_coalesced": "tensors", "all_gather": "tensor",
    "all_gather_single": "input_tensor", "all_gather_into_tensor": "input_tensor",
    "all_gather_coalesced": "input_tensor_list", "all_to_all": "input_tensor_list",
    "all_to_all_single": "input", "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input", "reduce_scatter_single": "input", "broadcast": "tensor",
    "reduce": "tensor", "gather": "tensor", "scatter": "scatter_list", "send": "tensor",
    "isend": "tensor", "recv": "tensor", "irecv": "tensor", "batch_isend_irecv": "p2p_op_list",
}
# the public names of the hook's three collectives (all_gather_single is torch 2.13's
# all_gather_into_tensor)
_OP_OF = {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
          "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather"}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return _nbytes(getattr(x, "tensor", None))  # a P2POp


class _Handed:
    """Every call into torch.distributed's collectives while ``on``, as ``(name, bytes this
    rank handed in)`` in the order issued. Outermost calls only (a collective built on
    another counts once); from any thread (the hook issues its later collectives from the
    backend's callbacks). ``fake``: no process group; each call completes at once, its
    output as if every rank had handed in what this one did (only sizes are under test)."""

    def __init__(self, *, fake: bool = False) -> None:
        import threading

        self.calls: list[tuple[str, int]] = []
        self.on = True
        self._fake = fake
        self._lock = threading.Lock()
        self._inside = threading.local()

    def install(self, patch: Callable[[str, Any], None]) -> None:
        """``patch(name, wrapper)`` for each collective this torch has."""
        for name, arg in _HANDED_ARG.items():
            real = getattr(dist, name, None)
            if real is not None:
                patch(name, self._wrap(name, arg, real))

    def _wrap(self, name: str, arg: str, real: Callable[..., Any]) -> Callable[..., Any]:
        import functools
        import inspect

        sig = inspect.signature(real)

        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outermost = not getattr(self._inside, "depth", 0)
            bound = sig.bind_partial(*args, **kwargs).arguments
            if outermost and self.on:
                with self._lock:
                    self.calls.append((name, _nbytes(bound.get(arg))))
            if self._fake:
                _as_if_every_rank_sent_this(name, bound)
                return _DoneWork()
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        return wrapper

    def by_op(self) -> list[tuple[str, int]]:
        """The calls under the hook's op names (an unknown call keeps its own name)."""
        return [(_OP_OF.get(name, name), n) for name, n in self.calls]


def _as_if_every_rank_sent_this(name: str, bound: dict[str, Any]) -> None:
    """A faked collective's output: every rank's part is this rank's (an all-reduce's sum
    is left as this rank's part: the values are not under test, only valid ones needed)."""
    if name == "all_to_all_single":
        bound["output"].copy_(bound["input"])
    elif name in ("all_gather_single", "all_gather_into_tensor"):
        out, inp = bound["output_tensor"], bound["input_tensor"]
        out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))


class _DoneWork:
    """A ``dist.Work`` whose collective has completed."""

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(None)
        return fut


def _patch_dist(name: str, fn: Any) -> None:
    """Patch a collective where the hook and torch look it up (a forked rank: no undo)."""
    from torch.distributed import distributed_c10d

    setattr(dist, name, fn)
    setattr(distributed_c10d, name, fn)


def _claimed_calls(method: str, cfg: CompressionConfig, world: int,
                   shapes: list[tuple[int, ...]]) -> list[tuple[str, int]]:
    """What each method says it hands torch.distributed for one bucket of gradients of
    ``shapes``: (op, bytes this rank hands in), in the order issued."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    n = sum(math.prod(s) for s in shapes)
    if method == "none":
        return [("all_reduce", 4 * n)]  # fp32, what DDP all-reduces without a hook
    if method in ("fp16", "bf16"):
        return [("all_reduce", 2 * n)]
    shard = -(-n // world)  # the two-phase methods: one shard per rank, the last padded
    if method in ("int8", "topk"):
        if method == "int8":  # an fp32 scale per block of the shard, a byte per element
            row = 4 * -(-shard // cfg.int8_block) + shard
        else:  # an fp32 value and an int32 index per pick of the shard
            row = 8 * topk_count(shard, cfg.topk_ratio)
        # phase 1 hands in every rank's row (all-to-all), phase 2 its own (all-gather)
        return [("all_to_all", world * row), ("all_gather", row)]
    assert method == "powersgd", method
    # torch's rule: a matrix goes as rank-r factors P (rows, r) and Q (cols, r) when that at
    # least halves it; everything else goes as it is, first
    small = p = q = 0
    for s in shapes:
        rows, cols = s[0], math.prod(s[1:])
        r = min(rows, cols, cfg.powersgd_rank)
        if len(s) > 1 and _should_compress(rows, cols, r, 2)[0]:
            p, q = p + rows * r, q + cols * r
        else:
            small += math.prod(s)
    return ([("all_reduce", 4 * small)] if small else []) + (
        [("all_reduce", 4 * p), ("all_reduce", 4 * q)] if p else [])


def _wire(calls: list[tuple[str, int]], world: int) -> int:
    """Bytes one rank sends for these calls under the ring model (``_math.WIRE_BYTES``)."""
    return sum(WIRE_BYTES[op](n, world) for op, n in calls)


def _reported_matches_handed(stats: CommStats, handed: list[tuple[str, int]],
                             world: int) -> None:
    """What the hook reports is what torch.distributed was handed: the per-op message bytes
    and calls (``traind_comm_collective_*``) measured, ``sent_bytes`` (``traind_comm_sent_
    bytes``) the ring model of exactly those calls."""
    got: dict[str, list[int]] = {}
    for c in stats.collectives:
        got.setdefault(c["op"], [0, 0])
        got[c["op"]][0] += c["calls"]
        got[c["op"]][1] += c["bytes"]
    want: dict[str, list[int]] = {}
    for op, n in handed:
        want.setdefault(op, [0, 0])
        want[op][0] += 1
        want[op][1] += n
    assert got == want, (got, want)
    assert stats.sent_bytes == _wire(handed, world), (stats.sent_bytes, _wire(handed, world))


class _BucketSpy:
    """A DDP hook state around the real hook: the gradient shapes of every bucket it gets."""

    def __init__(self, hook: CompressionHook) -> None:
        self.hook = hook
        self.buckets: list[list[tuple[int, ...]]] = []

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.buckets.append([tuple(g.shape) for g in bucket.gradients()])
        return self.hook(bucket)


HANDED_WORLD = 4
HANDED_STEPS = 2
# int8 at its default block; topk at 10% (at 1% a 600-element shard's ceil adds a sixth)
HANDED_CFG = CompressionConfig(method="none", topk_ratio=0.1, powersgd_start_step=2)


def _check_bytes_handed(rank: int, out: str) -> None:
    from traind.trainer.compression import comm_hook

    handed = _Handed()
    handed.install(_patch_dist)
    handed.on = False
    ddp = DDP(_mlp(), bucket_cap_mb=0.01)
    hook = CompressionHook(HANDED_CFG)
    spy = _BucketSpy(hook)
    ddp.register_comm_hook(spy, comm_hook)  # type: ignore[arg-type]

    def step(i: int) -> None:
        gen = torch.Generator().manual_seed(1000 * i + rank)
        ddp.zero_grad()
        ddp(torch.randn(32, 16, generator=gen)).square().mean().backward()

    # DDP rebuilds its buckets after the first step; PowerSGD compresses from step 2 on
    for i in range(2):
        step(i)
    hook.take_stats()
    got: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        hook.set_method(method)
        spy.buckets.clear()
        handed.calls.clear()
        handed.on = True  # forward and backward: whatever the step hands torch.distributed
        for i in range(HANDED_STEPS):
            step(2 + i)
        handed.on = False  # backward has returned: DDP has waited for every bucket
        stats = hook.take_stats()
        assert stats.steps == HANDED_STEPS, (method, stats)
        _reported_matches_handed(stats, handed.by_op(), HANDED_WORLD)
        got[method] = {"handed": handed.by_op(), "buckets": list(spy.buckets),
                       "raw": stats.raw_bytes, "sent": stats.sent_bytes}
    torch.save(got, f"{out}.{rank}")


# method -> (low, high) of its wire bytes over the fp32 all-reduce's of the same buckets:
# what the method claims, with the rounding its shards add
WIRE_CLAIMS: dict[str, tuple[float, float]] = {
    "none": (1.0, 1.0),
    "fp16": (0.5, 0.5),
    "bf16": (0.5, 0.5),
    # int8 + an fp32 scale per block; a shard's last block and the shard padding add < 2%
    "int8": ((1 + 4 / HANDED_CFG.int8_block) / 4, (1 + 4 / HANDED_CFG.int8_block) / 4 * 1.02),
    # 4 + 4 bytes per pick of a fraction r: 2r of fp32, plus one pick per shard at most
    "topk": (2 * HANDED_CFG.topk_ratio, 2 * HANDED_CFG.topk_ratio * 1.05),
    # rank-2 factors of the three weight matrices, the biases as they are: 696 / 5768
    "powersgd": (0.12, 0.121),
}


def test_every_method_hands_torch_distributed_what_it_claims(tmp_path: Path) -> None:
    """4 real gloo ranks, every method on the same buckets: the collectives each rank hands
    torch.distributed are exactly the method's layout (op, bytes, order, one set per bucket),
    the wire bytes of those calls stand to the fp32 all-reduce's as the method claims, and
    what the hook reports (per-op bytes measured, ``sent_bytes`` modelled) is those calls."""
    out = tmp_path / "handed"
    run_ranks(tmp_path, _check_bytes_handed, str(out), world=HANDED_WORLD)
    world, params = HANDED_WORLD, sum(p.numel() for p in _mlp().parameters())
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    fp32 = ranks[0]["none"]
    fp32_handed = sum(n for _, n in fp32["handed"])
    # the fp32 baseline is what DDP all-reduces without a hook: every gradient, 4 bytes each
    assert fp32_handed == 4 * params * HANDED_STEPS
    rows = []
    for method in METHODS:
        for rank, got in enumerate(ranks):
            m = got[method]
            assert sum(math.prod(s) for b in m["buckets"] for s in b) == params * HANDED_STEPS
            assert m["raw"] == 4 * params * HANDED_STEPS  # traind_comm_gradient_bytes
            claimed = [c for b in m["buckets"] for c in _claimed_calls(method, HANDED_CFG,
                                                                        world, b)]
            assert m["handed"] == claimed, (method, rank, m["handed"], claimed)
        m = ranks[0][method]
        handed = sum(n for _, n in m["handed"])
        wire_ratio = _wire(m["handed"], world) / _wire(fp32["handed"], world)
        if method in ("int8", "topk"):
            # two phases: the all-to-all hands in the world rows, the all-gather one of them,
            # so each phase sends (N-1)/N of the compressed bucket: 2 (N-1)/N in all, what a
            # ring all-reduce of it would
            a2a = sum(n for op, n in m["handed"] if op == "all_to_all")
            assert sum(n for op, n in m["handed"] if op == "all_gather") * world == a2a
            assert _wire(m["handed"], world) == 2 * (world - 1) * a2a // world
        lo, hi = WIRE_CLAIMS[method]
        assert lo - 1e-12 <= wire_ratio <= hi + 1e-12, (method, wire_ratio, (lo, hi))
        rows.append(f"{method:9} {handed // HANDED_STEPS:8} {handed / fp32_handed:8.4f} "
                    f"{_wire(m['handed'], world) // HANDED_STEPS:8} {wire_ratio:8.4f} "
                    f"{m['raw'] / m['sent']:8.4f}")
    print(f"\n{world} gloo ranks, {params} parameters, per step and rank:\n"
          "method    handed B  vs fp32  wire B*  vs fp32  raw/sent (the ratio gauge)\n"
          + "\n".join(rows) + "\n* modelled: ring factors on the bytes handed (WIRE_BYTES)")


class _FakeBucket:
    """One DDP bucket of a single flat parameter (the hook's calls only)."""

    def __init__(self, n: int) -> None:
        self._param = torch.nn.Parameter(torch.empty(0))
        gen = torch.Generator().manual_seed(n)
        self._buf = torch.randn(n, generator=gen)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def gradients(self) -> list[torch.Tensor]:
        return [self._buf]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self._param]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


@pytest.mark.parametrize("world", [8, 16])
def test_two_phase_methods_at_8_and_16_ranks_send_their_fraction_of_fp32(
        monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """The issue's bound at world sizes this machine cannot run: the real hook, Channel and
    methods on one 25 MiB bucket, with torch.distributed's collectives replaced by ones that
    record what they are handed and complete at once (rank 0 of ``world``). int8's wire
    bytes stay ~1/4 of the fp32 all-reduce's (at most 0.3x) and topk's 2 x its ratio at any
    world size, where gathering whole payloads would grow as N-1; sent_bytes are those
    calls'."""
    handed = _Handed(fake=True)
    handed.install(lambda name, fn: monkeypatch.setattr(dist, name, fn))
    n = 25 * 2**20 // 4
    calls: dict[str, list[tuple[str, int]]] = {}
    for method in ("none", "int8", "topk"):
        hook = CompressionHook(CompressionConfig(method=method))
        hook.compressor._world, hook.compressor._rank = world, 0
        handed.calls.clear()
        hook(_FakeBucket(n)).wait()  # type: ignore[arg-type]
        stats = hook.take_stats()
        calls[method] = handed.by_op()
        assert calls[method] == _claimed_calls(method, hook.cfg, world, [(n,)])
        _reported_matches_handed(stats, calls[method], world)
    fp32 = _wire(calls["none"], world)
    assert _wire(calls["int8"], world) / fp32 == pytest.approx((1 + 4 / 256) / 4, rel=1e-3)
    assert _wire(calls["int8"], world) / fp32 <= 0.3
    assert _wire(calls["topk"], world) / fp32 == pytest.approx(2 * 0.01, rel=1e-3)
