"""The trainer's CUDA-only lines, run on the CPU against stand-ins for ``torch.cuda`` (and for
the few tensor and torch.distributed calls that need a GPU): each test says what the line
must ask of CUDA. What only a GPU can show (that CUDA does what is asked) is
bench/gpu_check.py's; trainer/device.py's lines are tests/trainer/test_device.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist

from traind.trainer import distributed, parallel
from traind.trainer.config import DataConfig, ParallelConfig, TrainConfig
from traind.trainer.corpus_cache import CorpusCache
from traind.trainer.distributed import DistInfo, pick_device, setup
from traind.trainer.loop import train
from traind.trainer.pipeline import DataPipeline
from traind.trainer.recovery import _rng_state, _set_rng_state
from traind.trainer.sink import ListSink
from traind.trainer.timing import PhaseTimer

if TYPE_CHECKING:
    from pathlib import Path

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class FakeCuda:
    """Stands in for ``torch.cuda`` on a node with ``count`` GPUs: records what is asked."""

    def __init__(self, count: int = 2, *, initialized: bool = True) -> None:
        self.count, self.initialized = count, initialized
        self.current: torch.device | None = None
        self.rng = torch.tensor([7, 7, 7], dtype=torch.uint8)
        self.restored: list[torch.Tensor] = []
        self.events: list[FakeEvent] = []
        self.clock_ms = 0.0  # the device's timeline, advanced by each recorded event
        self.synced_to = -1  # the last event the host has waited for (its index)
        self.waits = 0

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, device: torch.device) -> None:
        self.current = device

    def is_initialized(self) -> bool:
        return self.initialized

    def get_rng_state(self) -> torch.Tensor:
        return self.rng.clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.restored.append(state)

    def Event(self, *, enable_timing: bool = False) -> FakeEvent:  # torch.cuda.Event
        assert enable_timing, "an event without timing has no elapsed_time"
        self.events.append(event := FakeEvent(self, len(self.events)))
        return event


class FakeEvent:
    """A CUDA event: recorded on the stream, readable once the host has waited for it (or a
    later event on the same stream)."""

    def __init__(self, cuda: FakeCuda, index: int) -> None:
        self.cuda, self.index = cuda, index
        self.at_ms: float | None = None
        self.elapsed_reads = 0

    def record(self) -> None:
        assert self.at_ms is None, "recorded twice"
        self.cuda.clock_ms += 10.0 * (self.index % 5)  # phases of 10, 20, 30, 40 ms
        self.at_ms = self.cuda.clock_ms

    def synchronize(self) -> None:
        self.cuda.waits += 1
        self.cuda.synced_to = max(self.cuda.synced_to, self.index)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at_ms is not None and end.at_ms is not None, "an event never recorded"
        assert self.cuda.synced_to >= end.index, "read before the host waited for the event"
        self.elapsed_reads += 1
        return end.at_ms - self.at_ms


# -- trainer/distributed.py: device choice, set_device, the backend --------------------------


def test_rank_i_on_a_node_takes_gpu_i() -> None:
    two = FakeCuda(2)
    assert pick_device("auto", 0, two) == CUDA0
    assert pick_device("auto", 1, two) == CUDA1
    assert pick_device("cuda", 3, two) == CUDA1  # more ranks than GPUs: wrap around
    assert pick_device("cpu", 1, two) == torch.device("cpu")
    none = FakeCuda(0)
    assert pick_device("auto", 1, none) == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device("cuda", 0, none)


@pytest.fixture
def no_group(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """torch.distributed with no group yet, and an init_process_group that records its
    arguments instead of joining one."""
    joined: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: joined.append(kw))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    return joined


def test_a_torchrun_rank_sets_its_gpu_and_joins_nccl(no_group: list[dict[str, Any]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                       "MASTER_ADDR": "10.0.0.1"}.items():
        monkeypatch.setenv(var, value)
    cuda = FakeCuda(2)
    info = setup("auto", cuda=cuda)
    assert info == DistInfo(3, 1, 4, CUDA1, owns_group=True)
    assert cuda.current == CUDA1  # set before the group: NCCL binds the current device
    assert no_group == [{"backend": "nccl"}]


def test_a_cpu_rank_joins_gloo_and_sets_no_device(no_group: list[dict[str, Any]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.0.0.1"}.items():
        monkeypatch.setenv(var, value)
    cuda = FakeCuda(2)
    info = setup("cpu", cuda=cuda)
    assert info.device == torch.device("cpu") and cuda.current is None
    assert no_group == [{"backend": "gloo"}]


def test_a_single_rank_group_on_a_gpu_is_nccl_with_a_store_of_its_own(
        no_group: list[dict[str, Any]]) -> None:
    cuda = FakeCuda(1)
    info = setup("cuda", single_rank_group=True, cuda=cuda)
    assert info == DistInfo(0, 0, 1, CUDA0, owns_group=True) and cuda.current == CUDA0
    [kw] = no_group
    assert (kw["backend"], kw["rank"], kw["world_size"]) == ("nccl", 0, 1)
    assert kw["init_method"].startswith("tcp://127.0.0.1:")


def test_a_group_set_up_by_the_caller_still_gets_its_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "0")
    cuda = FakeCuda(2)
    info = setup("auto", cuda=cuda)
    assert info == DistInfo(2, 0, 4, CUDA0, owns_group=False) and cuda.current == CUDA0


def test_backend_by_device() -> None:
    assert distributed.backend(CUDA1) == "nccl"
    assert distributed.backend(torch.device("cpu")) == "gloo"


# -- trainer/timing.py: step phases by CUDA events --------------------------------------------


def test_cuda_phase_events_are_recorded_and_read_only_on_telemetry_steps() -> None:
    """As the loop drives it (trainer/loop.py: ``start(enabled=report)``): on the steps
    between telemetry reads no event is made, recorded or read; a telemetry step records one
    per mark, the host waits once (on the last), and each span is read from the events."""
    cuda = FakeCuda()
    timer = PhaseTimer(CUDA0, cuda=cuda)
    every, phases = 5, ("data", "forward", "backward", "optimizer")
    reads = []
    for step in range(1, 11):
        report = step % every == 0
        made = len(cuda.events)
        timer.start(enabled=report)
        for name in phases:
            timer.mark(name)
        if not report:
            assert len(cuda.events) == made, f"step {step}: events on a step nobody reads"
            continue
        new = cuda.events[made:]
        assert len(new) == 1 + len(phases) and all(e.at_ms is not None for e in new)
        assert cuda.synced_to < new[0].index  # marking never waits for the device
        reads.append(timer.read())
        assert cuda.synced_to == new[-1].index  # reading waits once, on the last event
        assert cuda.waits == len(reads)
        # one elapsed_time per phase and one for the total, all on this step's events
        assert sum(e.elapsed_reads for e in new) == len(phases) + 1
    assert len(cuda.events) == 2 * (1 + len(phases))  # two telemetry steps of ten
    assert reads == [{"data": 0.01, "forward": 0.02, "backward": 0.03, "optimizer": 0.04,
                      "total": pytest.approx(0.1)}] * 2


# -- trainer/recovery.py: the CUDA generator in a checkpoint ----------------------------------


def test_the_cuda_rng_state_is_saved_and_restored_once_cuda_is_in_use() -> None:
    cuda = FakeCuda()
    state = _rng_state(cuda)
    assert torch.equal(state["cuda"], cuda.rng) and torch.equal(state["cpu"],
                                                                torch.get_rng_state())
    _set_rng_state(state, cuda)
    assert len(cuda.restored) == 1 and torch.equal(cuda.restored[0], cuda.rng)
    # CUDA not yet initialised (a CPU job on a GPU node): nothing asked of it, none saved
    idle = FakeCuda(initialized=False)
    assert set(_rng_state(idle)) == {"cpu"}
    # a checkpoint written on a GPU restored where there is none: the CPU state only
    _set_rng_state(state, FakeCuda(0))


# -- trainer/pipeline.py and prefetch.py: pinned batches, copied without a wait ----------------


def test_on_cuda_batches_are_pinned_and_copied_to_the_device_without_blocking(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: set[int] = set()
    copies: list[tuple[torch.device, bool, bool]] = []
    to = torch.Tensor.to

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        out = self.clone()
        pinned.add(id(out))
        return out

    def fake_to(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copies.append((args[0], id(self) in pinned, kw.get("non_blocking", False)))
            return self
        return to(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    cfg = DataConfig(max_bytes=100_000)
    with DataPipeline.build(cfg, batch_size=4, seq_len=32, seed=0, device=CUDA1,
                            cache=CorpusCache()) as data:
        assert data.batches.pin and data.batches.depth == 2  # "auto" on CUDA
        assert data.stage_to == CUDA1 and "device" in data.tiers.counts
        for _ in range(3):
            x, y = data.next()
            assert x.shape == y.shape == (4, 32)
    # every batch handed over (three, and the fourth staged) went pinned, asynchronously
    assert copies == [(CUDA1, True, True)] * 8
    with DataPipeline.build(cfg, batch_size=4, seq_len=32, seed=0,
                            device=torch.device("cpu"), cache=CorpusCache()) as data:
        assert not data.batches.pin and data.stage_to is None and data.batches.depth == 0


# -- trainer/parallel.py: DDP on the rank's own GPU -------------------------------------------


class FakeDDP:
    made: list[dict[str, Any]]

    def __init__(self, module: torch.nn.Module, **kw: Any) -> None:
        self.made.append(kw)

    def _set_ddp_runtime_logging_sample_rate(self, rate: int) -> None:
        pass


@pytest.mark.parametrize(("device", "ids"), [(CUDA1, [1]), (torch.device("cpu"), None)])
def test_ddp_gets_the_ranks_gpu_as_its_device_ids(monkeypatch: pytest.MonkeyPatch,
                                                  device: torch.device,
                                                  ids: list[int] | None) -> None:
    monkeypatch.setattr(FakeDDP, "made", [], raising=False)
    monkeypatch.setattr(parallel, "DistributedDataParallel", FakeDDP)
    info = DistInfo(rank=3, local_rank=1, world_size=4, device=device, owns_group=True)
    strategy = parallel.DDP(ParallelConfig(strategy="ddp"), info)
    strategy.wrap(torch.nn.Linear(2, 2))
    [kw] = FakeDDP.made
    assert kw["device_ids"] == ids


# -- trainer/loop.py: TF32 and the A/B block's synchronize go through trainer/device.py -------


def test_the_loop_allows_tf32_and_syncs_each_ab_step_through_the_device_seams(
        tmp_path: Path, make_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the seams do nothing; what they do on CUDA is tests/trainer/test_device.py's.
    Here: the loop calls them, TF32 once per run and the block's wait once per step."""
    from traind.trainer import loop

    tf32: list[torch.device] = []
    waits: list[torch.device] = []
    monkeypatch.setattr(loop, "allow_tf32", tf32.append)
    monkeypatch.setattr(loop, "device_synchronize", waits.append)
    cfg = make_config(tmp_path, steps=4, checkpoint_every=1000, eval_every=1000)
    cfg = TrainConfig.model_validate({**cfg.model_dump(), "interleave": {
        "arms": [{"name": "A"}, {"name": "B", "precision": "bf16"}],
        "block_steps": 2, "warmup_steps": 0}})
    train(cfg, ListSink())
    assert tf32 == [torch.device("cpu")]
    assert waits == [torch.device("cpu")] * 4
    waits.clear()
    train(make_config(tmp_path / "plain", steps=3, checkpoint_every=1000, eval_every=1000),
          ListSink())
    assert waits == []  # no experiment: no per-step sync


def test_the_probes_wait_for_the_device_around_each_timed_collective(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's collectives return before they are done: the all-reduce probe and the link
    probe's clock read the time only after the device's queue (device_synchronize, whose
    CUDA call the test above checks)."""
    from traind.trainer import linkprobe, probe

    calls: list[str] = []
    monkeypatch.setattr(probe, "device_synchronize", lambda d: calls.append("sync"))
    monkeypatch.setattr(probe.dist, "all_reduce", lambda buf: calls.append("reduce"))
    probe.all_reduce_probe([64, 1024], repeats=3, device=torch.device("cpu"))
    # per size: a warm-up, then each repeat timed between two waits
    assert calls == (["reduce"] + ["sync", "reduce", "sync"] * 3) * 2
    waited: list[torch.device] = []
    monkeypatch.setattr(linkprobe, "device_synchronize", waited.append)
    now = linkprobe._timer(CUDA1)
    now()
    assert waited == [CUDA1]
