"""Admission control: jobs this node cannot run are refused before launch, naming the field."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from tests.daemon.test_node import _node
from traind.daemon.admission import (
    GIB,
    SHIPPED_RANKS,
    Resources,
    check,
    factory_params,
    problems,
    refusals,
    resources,
    shipped_job,
    shipped_ranks,
)
from traind.daemon.config import ConfigError, load_settings
from traind.daemon.service import ExperimentSpec
from traind.trainer.config import TrainConfig
from traind.trainer.footprint import footprint, param_count

if TYPE_CHECKING:
    from pathlib import Path

CPU_NODE = Resources(cpus=2, memory_bytes=16 * GIB, gpus=0)
GPU_NODE = Resources(cpus=16, memory_bytes=128 * GIB, gpus=1, gpu_memory_bytes=140 * GIB)


def cfg(**tree: dict[str, object]) -> TrainConfig:
    return TrainConfig.model_validate(tree)


@pytest.mark.parametrize(("tree", "node", "field"), [
    ({"job": {"device": "cuda"}}, CPU_NODE, "job.device"),
    ({"job": {"nproc_per_node": 512}}, CPU_NODE, "job.nproc_per_node"),
    ({"job": {"nproc_per_node": 2, "device": "cuda"}}, GPU_NODE, "job.nproc_per_node"),
    ({"job": {"threads": 64}}, CPU_NODE, "job.threads"),
    ({"model": {"d_model": 65536, "n_heads": 64}}, CPU_NODE, "model"),
    ({"job": {"batch_size": 100_000}}, CPU_NODE, "model"),
    ({"model": {"d_model": 65536, "n_heads": 64}}, GPU_NODE, "model"),
])
def test_a_job_the_node_cannot_run_is_refused_naming_the_field(
        tree: dict[str, dict[str, object]], node: Resources, field: str) -> None:
    found = problems(cfg(**tree), node)
    assert any(line.startswith(f"{field}: ") for line in found), found


def test_a_refusal_carries_each_field_as_a_loc() -> None:
    with pytest.raises(ConfigError) as exc:
        check(cfg(job={"nproc_per_node": 512, "threads": 64, "device": "cuda"}), CPU_NODE)
    assert [loc for loc, _ in exc.value.errors] == [
        ("job", "device"), ("job", "threads")]  # a cuda job's ranks are not counted on CPUs
    assert str(exc.value).startswith("this node cannot run the job:\n  job.device: cuda, but")


@pytest.mark.parametrize("tree", [{}, {"job": {"nproc_per_node": 2}},
                                  {"model": {"d_model": 512, "n_layers": 8}}])
def test_a_job_that_fits_is_admitted(tree: dict[str, dict[str, object]]) -> None:
    assert problems(cfg(**tree), CPU_NODE) == []


def test_the_node_counts_the_cpus_its_ranks_size_their_threads_by(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # one home for the count (trainer/threads.py): a cgroup quota below the affinity mask
    # is what admission checks jobs against
    monkeypatch.setattr("traind.daemon.admission.usable_cpus", lambda: 1)
    node = resources()
    assert node.cpus == 1
    assert [loc for loc, _ in refusals(cfg(job={"nproc_per_node": 2}), node)] == [
        ("job", "nproc_per_node")]


def test_oversubscribing_is_allowed_when_asked() -> None:
    big = cfg(job={"nproc_per_node": 8})
    assert problems(big, CPU_NODE) and problems(big, CPU_NODE, oversubscribe=True) == []


# -- the shipped job: what `traind serve` trains given no config file -------------------------

ONE_CPU = Resources(cpus=1, memory_bytes=16 * GIB, gpus=0)
EIGHT_GPUS = Resources(cpus=64, memory_bytes=1024 * GIB, gpus=8, gpu_memory_bytes=80 * GIB)


@pytest.mark.parametrize(("job", "node", "ranks"), [
    ({}, CPU_NODE, 2),  # a laptop: two gloo ranks, so the Communication page has data
    ({}, ONE_CPU, 1),  # as many as admission lets through, never refused
    ({}, GPU_NODE, 1),  # one rank per GPU
    ({"device": "cpu"}, GPU_NODE, 2),  # its ranks count CPUs, not the one GPU
    ({}, EIGHT_GPUS, 2),
])
def test_the_shipped_job_runs_two_ranks_where_admission_allows(
        job: dict[str, object], node: Resources, ranks: int) -> None:
    assert SHIPPED_RANKS == 2
    assert shipped_ranks(cfg(job=job).job, node) == ranks
    settings = shipped_job(load_settings(env={"TRAIND_JOB__STEPS": "500", **{
        f"TRAIND_JOB__{k.upper()}": str(v) for k, v in job.items()}}), None, node)
    assert settings.job.nproc_per_node == ranks
    assert settings.job.steps == 500  # the rest as loaded
    assert problems(settings, node) == []  # admitted as it is


def test_the_shipped_ranks_are_only_for_serve_without_a_config(tmp_path: Path) -> None:
    toml = tmp_path / "traind.toml"
    toml.write_text("[job]\nsteps = 10\n")
    # a config file's job keeps JobConfig's one rank (as `traind run` does)
    assert shipped_job(load_settings(toml, env={}), toml, CPU_NODE).job.nproc_per_node == 1
    # so does a job whose ranks the environment or --set name, whatever the number
    for one in (load_settings(env={"TRAIND_JOB__NPROC_PER_NODE": "1"}),
                load_settings(env={}, overrides=["job.nproc_per_node=1"])):
        assert shipped_job(one, None, CPU_NODE).job.nproc_per_node == 1
    assert shipped_job(load_settings(env={}), None, CPU_NODE).job.nproc_per_node == 2


@pytest.mark.parametrize("model", [{}, {"d_model": 96, "n_heads": 3, "n_layers": 3},
                                   {"mlp_hidden": 100}, {"vocab_size": 300}])
def test_the_parameter_count_is_the_models(model: dict[str, object]) -> None:
    from traind.trainer.model import GPT

    c = cfg(model=model)
    assert param_count(c.model) == GPT(c.model).num_params()


def test_the_estimate_grows_with_the_batch_and_shrinks_with_checkpointing() -> None:
    small, big = cfg(job={"batch_size": 8}), cfg(job={"batch_size": 64})
    assert footprint(big).activations_bytes > 4 * footprint(small).activations_bytes
    ckpt = cfg(job={"batch_size": 64}, model={"activation_checkpointing": True})
    assert footprint(ckpt).activations_bytes < footprint(big).activations_bytes


def test_the_daemon_refuses_an_experiment_it_cannot_run_before_recording_it(
        tmp_path: Path) -> None:
    node = _node(tmp_path)
    spec = ExperimentSpec(name="too-big", steps=80, arms=({"name": "a"}, {"name": "b"}),
                          overrides={"job.nproc_per_node": 512})
    with pytest.raises(ConfigError, match=r"job\.nproc_per_node: 512 ranks"):
        asyncio.run(node.service.submit_experiment(spec))
    forked = ExperimentSpec(name="cuda", steps=10, mode="forked",
                            arms=({"name": "a"}, {"name": "b"}),
                            overrides={"job.device": "cuda"})
    with pytest.raises(ConfigError, match=r"job\.device: cuda"):
        asyncio.run(node.service.submit_experiment(forked))
    assert node.service.experiments() == []


FACTORIES = '''
from torch import nn

def wide(vocab_size, d_model):
    return nn.Sequential(nn.Embedding(vocab_size, d_model), nn.Linear(d_model, vocab_size))

def huge(vocab_size):  # 64 Gi parameters: built on the meta device, it takes no memory
    return nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(2**18, 2**18))

def broken(vocab_size):
    raise RuntimeError("the user's bug")
'''


def test_a_factory_model_is_measured_in_a_child_process_and_refused_by_its_own_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon imports neither torch nor the user's code: a child process builds the model
    on the meta device and counts its parameters (not the model.* fields' GPT)."""
    (tmp_path / "fact_models.py").write_text(FACTORIES)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    fits = cfg(model={"factory": "fact_models:wide", "d_model": 64})
    params = factory_params(fits.model)
    assert params == 256 * 64 + 64 * 256 + 256
    assert refusals(fits, CPU_NODE, params=params) == []
    with pytest.raises(ConfigError) as exc:
        check(cfg(model={"factory": "fact_models:huge"}), CPU_NODE)
    (loc, msg), = exc.value.errors
    assert loc == ("model", "factory") and "68,719,740,928 parameters" in msg
    assert "its activations not estimated" in msg
    for tree, why in (({"model": {"factory": "fact_models:broken"}},
                       "RuntimeError: the user's bug"),
                      ({"model": {"factory": "fact_models:wide"}, "parallel": {"tp": 2},
                        "job": {"nproc_per_node": 2}}, "Sequential carries no tp_plan")):
        with pytest.raises(ConfigError) as exc:  # refused before anything is recorded
            check(cfg(**tree), CPU_NODE)
        assert exc.value.errors[0][0] == ("model", "factory") and why in str(exc.value)
