"""trainer/attention_choice.py, and auto in attend(): the backend is measured, then cached."""

from __future__ import annotations

import itertools
import warnings
from typing import TYPE_CHECKING

import pytest
import torch

from traind.trainer import attention
from traind.trainer.attention import attend, mask_matrix, naive_attention
from traind.trainer.attention_choice import (
    BackendChoice,
    ChoiceKey,
    Name,
    candidates,
    median_seconds,
    pick,
    static_choice,
)
from traind.trainer.config import ModelConfig
from traind.trainer.model import GPT

if TYPE_CHECKING:
    from collections.abc import Callable

KEY = ChoiceKey("cuda:0", torch.bfloat16, (2, 4, 256, 32), 32, 4, True, "")


@pytest.mark.parametrize(
    ("device", "triton", "flex", "dropout", "expected"),
    [
        ("cpu", True, True, False, ("sdpa_mask",)),  # flex has no CPU backward; triton is CUDA's
        ("cuda", True, True, False, ("sdpa_mask", "triton", "flex")),
        ("cuda", False, True, False, ("sdpa_mask", "flex")),  # no triton installed
        ("cuda", True, False, False, ("sdpa_mask", "triton")),  # an old torch without flex
        ("cuda", True, True, True, ("sdpa_mask",)),  # only SDPA has dropout
        ("mps", True, True, False, ("sdpa_mask",)),
    ],
)
def test_candidates_table(device: str, triton: bool, flex: bool, dropout: bool,
                          expected: tuple[str, ...]) -> None:
    assert candidates(device_type=device, has_triton=triton, has_flex=flex,
                      dropout=dropout) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({"sdpa_mask": 3.0, "triton": 1.0, "flex": 2.0}, "triton"),
        ({"sdpa_mask": 3.0, "triton": 2.0, "flex": 1.0}, "flex"),
        ({"sdpa_mask": 1.0, "triton": 0.97}, "sdpa_mask"),  # 3% faster is noise: keep the first
        ({"sdpa_mask": 1.0, "triton": 0.94}, "triton"),  # 6% is not
        ({"sdpa_mask": 1.0, "triton": 0.5, "flex": 0.49}, "triton"),  # ties go to the earlier
        ({"sdpa_mask": 1.0, "triton": None, "flex": 2.0}, "sdpa_mask"),  # a failure never wins
        ({"sdpa_mask": None, "triton": 2.0}, "triton"),
        ({"sdpa_mask": None, "triton": None}, None),
        ({}, None),
    ],
)
def test_pick_table(seconds: dict[Name, float | None], expected: Name | None) -> None:
    assert pick(seconds) == expected


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("sdpa_mask", "triton", "flex"), "triton"),
        (("sdpa_mask", "flex"), "flex"),
        (("sdpa_mask",), "sdpa_mask"),
    ],
)
def test_static_choice_table(names: tuple[Name, ...], expected: Name) -> None:
    assert static_choice(names) == expected


def test_median_seconds_skips_the_warmups_and_syncs_around_each_timed_call() -> None:
    events: list[str] = []
    # each timed call takes (stop - start) on this fake clock: 5, 1, 9, 2, 7 -> median 5
    ticks = iter([0, 5, 10, 11, 20, 29, 30, 32, 40, 47])
    calls = itertools.count()

    def trial() -> None:
        events.append(f"call{next(calls)}")

    got = median_seconds(trial, sync=lambda: events.append("sync"), clock=lambda: next(ticks),
                         warmup=2, reps=5)
    assert got == 5
    assert events[:2] == ["call0", "call1"]  # warm-ups: untimed, so no sync either
    assert events[2:6] == ["sync", "call2", "sync", "sync"]
    assert events.count("sync") == 10


class FakeTimer:
    """Seconds per candidate from a table (a missing name raises, like a backend that fails);
    it runs each trial once, so a trial that breaks is seen."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.timed = seconds, []  # type: list[str]

    def __call__(self, name: Name, trial: Callable[[], object]) -> float:
        self.timed.append(name)
        trial()
        return self.seconds[name]


def test_measures_once_per_key_then_answers_from_the_cache() -> None:
    timer = FakeTimer({"sdpa_mask": 3.0, "triton": 1.0, "flex": 2.0})
    choice = BackendChoice(timer)
    ran: list[str] = []
    names: tuple[Name, ...] = ("sdpa_mask", "triton", "flex")

    def trial(name: Name) -> Callable[[], object]:
        return lambda: ran.append(name)

    assert choice.choose(KEY, names, trial) == "triton"
    assert choice.choose(KEY, names, trial) == "triton"
    assert timer.timed == ["sdpa_mask", "triton", "flex"] and ran == timer.timed
    other = ChoiceKey("cuda:0", torch.bfloat16, (2, 4, 512, 32), 32, 4, True, "")
    timer.seconds["flex"] = 0.5  # another shape, another answer
    assert choice.choose(other, names, trial) == "flex"
    assert len(timer.timed) == 6
    decided = choice.decided()
    assert decided[KEY].name == "triton" and decided[other].name == "flex"
    assert dict(decided[KEY].seconds) == {"sdpa_mask": 3.0, "triton": 1.0, "flex": 2.0}


def test_a_single_candidate_is_never_timed() -> None:
    timer = FakeTimer({})
    assert BackendChoice(timer).choose(KEY, ("sdpa_mask",), lambda n: lambda: None) == "sdpa_mask"
    assert timer.timed == []


def test_a_failing_backend_is_skipped_with_one_warning() -> None:
    choice = BackendChoice(FakeTimer({"sdpa_mask": 3.0, "flex": 2.0}))  # triton: KeyError

    def trial(name: Name) -> Callable[[], object]:
        return lambda: None

    names: tuple[Name, ...] = ("sdpa_mask", "triton", "flex")
    with pytest.warns(UserWarning, match="'triton' failed at first use") as caught:
        assert choice.choose(KEY, names, trial) == "flex"
    assert len(caught) == 1
    other = ChoiceKey("cuda:0", torch.float32, (1, 1, 64, 16), 8, 0, False, "tf32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure of the same backend is silent
        assert choice.choose(other, names, trial) == "flex"
    assert dict(choice.decided()[other].seconds)["triton"] is None


def test_when_nothing_runs_the_first_candidate_is_returned_to_raise_its_own_error() -> None:
    choice = BackendChoice(FakeTimer({}))
    with pytest.warns(UserWarning):
        assert choice.choose(KEY, ("sdpa_mask", "flex"), lambda n: lambda: None) == "sdpa_mask"


def test_inside_a_compile_trace_nothing_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_mask": 1.0, "triton": 3.0})
    choice = BackendChoice(timer)
    names: tuple[Name, ...] = ("sdpa_mask", "triton")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choice.choose(KEY, names, lambda n: lambda: None) == "triton"  # the static rule
    assert timer.timed == [] and choice.decided() == {}  # and nothing cached from a guess
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert choice.choose(KEY, names, lambda n: lambda: None) == "sdpa_mask"  # measured
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choice.choose(KEY, names, lambda n: lambda: None) == "sdpa_mask"  # from the cache
    assert timer.timed == ["sdpa_mask", "triton"]


# --- auto in attend(): a second candidate on the CPU, the Triton twin under the name "triton"


@pytest.fixture
def two_backends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """attend() on the CPU with two candidates: SDPA with a mask, and a spy standing in for
    the kernel (its SDPA twin). Returns the names of the implementations that ran."""
    from traind.kernels import swa

    ran: list[str] = []
    real_sdpa = attention.IMPLEMENTATIONS["sdpa_mask"]

    def sdpa(*a: torch.Tensor, **kw: int) -> torch.Tensor:
        ran.append("sdpa_mask")
        return real_sdpa(*a, **kw)

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
               global_tokens: int) -> torch.Tensor:
        ran.append("triton")
        return swa.swa_torch(q, k, v, window, global_tokens)

    monkeypatch.setitem(attention.IMPLEMENTATIONS, "sdpa_mask", sdpa)
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "triton", kernel)
    monkeypatch.setattr(attention, "candidates", lambda **_: ("sdpa_mask", "triton"))
    return ran


def _cfg(**kw: object) -> ModelConfig:
    return ModelConfig(attention="sliding_window", window=6, global_tokens=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seconds", "winner"), [({"sdpa_mask": 2.0, "triton": 1.0}, "triton"),
                                                 ({"sdpa_mask": 1.0, "triton": 2.0}, "sdpa_mask")])
def test_auto_runs_the_measured_winner(two_backends: list[str], seconds: dict[str, float],
                                       winner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer(seconds)
    monkeypatch.setattr(attention, "CHOICE", BackendChoice(timer))
    q, k, v = (torch.randn(2, 2, 20, 8, requires_grad=True) for _ in range(3))
    rng = torch.get_rng_state()
    out = attend(q, k, v, cfg=_cfg())
    assert torch.equal(torch.get_rng_state(), rng)  # the trials drew no random numbers
    assert two_backends == ["sdpa_mask", "triton", winner]  # one trial each, then the call
    torch.testing.assert_close(out, naive_attention(q, k, v, mask_matrix(20, 6, 2)))
    assert q.grad is None  # the trials ran on copies
    two_backends.clear()
    attend(q, k, v, cfg=_cfg())
    assert two_backends == [winner] and len(timer.timed) == 2  # cached
    with torch.no_grad():  # forward only is another measurement
        attend(q, k, v, cfg=_cfg())
    assert len(timer.timed) == 4


def test_auto_with_dropout_and_forced_backends_measure_nothing(
        two_backends: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({})
    monkeypatch.setattr(attention, "CHOICE", BackendChoice(timer))
    monkeypatch.setattr(attention, "candidates", candidates)  # the real rule: dropout -> SDPA
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    attend(q, k, v, cfg=_cfg(), dropout_p=0.1)
    attend(q, k, v, cfg=_cfg(attention_backend="triton"))
    assert two_backends == ["sdpa_mask", "triton"] and timer.timed == []


def test_config_rejects_a_backend_without_dropout() -> None:
    with pytest.raises(ValueError, match="attention_backend 'flex' has no dropout"):
        _cfg(attention_backend="flex", dropout=0.1)
    assert _cfg(attention_backend="auto", dropout=0.1).attention_backend == "auto"


@pytest.mark.parametrize(("checkpointing", "offload"), [(True, False), (False, True)])
def test_measuring_inside_checkpointed_or_offloaded_blocks(
        two_backends: list[str], checkpointing: bool, offload: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call happens inside the block's checkpoint (or save_on_cpu): its saved-tensor
    hooks must not capture the trials, and loss and gradients stay those of plain SDPA. The
    real CPU timer runs here."""
    monkeypatch.setattr(attention, "CHOICE", BackendChoice())
    base = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, attention="sliding_window",
                       window=5, global_tokens=1)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for cfg in (base.model_copy(update={"attention_backend": "sdpa_mask"}),
                base.model_copy(update={"activation_checkpointing": checkpointing,
                                        "activation_offload": offload})):
        torch.manual_seed(0)
        model = GPT(cfg).train()
        _, loss = model(idx, idx.roll(-1, dims=1))
        assert loss is not None
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert len(attention.CHOICE.decided()) == 1  # one shape, measured once, in both blocks
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=0)
    for g, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_compiled_attend_uses_the_cache_and_never_times(
        two_backends: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_mask": 1.0, "triton": 2.0})
    monkeypatch.setattr(attention, "CHOICE", BackendChoice(timer))
    cfg = _cfg()
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    fn = torch.compile(lambda a, b, c: attend(a, b, c, cfg=cfg), backend="eager",
                       fullgraph=True)
    with torch.no_grad():
        fn(q, k, v)  # never measured: the static rule, the kernel
        assert two_backends == ["triton"] and timer.timed == []
        attend(q, k, v, cfg=cfg)  # eager: measured, SDPA wins
        torch._dynamo.reset()
        two_backends.clear()
        fn(q, k, v)  # traced again: the cached winner
    assert two_backends == ["sdpa_mask"] and len(timer.timed) == 2


def test_the_bench_table_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/attention.py's rows for one tiny CPU shape: the same trials and timer as auto."""
    import importlib.util

    from tests.conftest import REPO

    path = REPO / "bench" / "attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(attention, "CHOICE", attention.CHOICE)  # the bench replaces it
    rows = bench.rows_for(torch.device("cpu"), torch.float32, (1, 2, 64, 8, 8, 2), "ieee", False)
    by_name = {r[1]: r for r in rows}
    assert list(by_name) == ["sdpa_mask", "triton", "flex", "sdpa is_causal"]
    assert float(by_name["sdpa_mask"][3]) > 0 and by_name["sdpa_mask"][4] == "1.00"
    assert by_name["sdpa_mask"][5].startswith("<- auto (1 candidate)")
    assert "CUDA only" in by_name["triton"][5]
    assert "NotImplementedError" in by_name["flex"][5]  # no CPU backward, even in torch 2.13


def test_the_cuda_timer_synchronises_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake torch.cuda.synchronize: the GPU's queued kernels must be inside each timing."""
    from traind.trainer.attention_choice import device_timer

    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    calls: list[int] = []
    seconds = device_timer(torch.device("cuda", 1))("triton", lambda: calls.append(1))
    assert seconds >= 0 and len(calls) == 7  # 2 warm-ups, 5 timed
    assert synced == [torch.device("cuda", 1)] * 10
    synced.clear()
    device_timer(torch.device("cpu"))("sdpa_mask", lambda: None)
    assert synced == []


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_choose_ahead_fills_the_cache_a_compiled_model_then_reads(
        two_backends: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_mask": 1.0, "triton": 2.0})
    monkeypatch.setattr(attention, "CHOICE", BackendChoice(timer))
    cfg = _cfg()
    rng = torch.get_rng_state()
    assert attention.choose_ahead(cfg, (1, 2, 20, 8), torch.device("cpu"), torch.float32,
                                  grad=False) == "sdpa_mask"
    assert torch.equal(torch.get_rng_state(), rng)
    # nothing to choose: full attention, a window covering T, a forced backend
    assert attention.choose_ahead(cfg, (1, 2, 6, 8), torch.device("cpu"), torch.float32) is None
    assert attention.choose_ahead(_cfg(attention_backend="flex"), (1, 2, 20, 8),
                                  torch.device("cpu"), torch.float32) is None
    two_backends.clear()
    fn = torch.compile(lambda a, b, c: attend(a, b, c, cfg=cfg), backend="eager",
                       fullgraph=True)
    with torch.no_grad():
        fn(*(torch.randn(1, 2, 20, 8) for _ in range(3)))
    assert two_backends == ["sdpa_mask"] and len(timer.timed) == 2  # not the static kernel
