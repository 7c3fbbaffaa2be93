import re
from pathlib import Path
from typing import Any

import pytest

from traind.daemon.config import ConfigError, load_settings, validate


def test_defaults_need_nothing():
    s = load_settings(env={})
    assert s.daemon.host == "127.0.0.1"
    assert s.daemon.port == 8800
    assert s.job.steps > 0


def test_precedence_toml_then_env_then_flags(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("[job]\nsteps = 10\nbatch_size = 3\n[daemon]\nport = 9001\n")
    s = load_settings(f, env={"TRAIND_JOB__STEPS": "20", "TRAIND_DAEMON__PORT": "9002"},
                      overrides=["job.steps=30"])
    assert (s.job.steps, s.job.batch_size, s.daemon.port) == (30, 3, 9002)


def test_env_lists_and_strings():
    s = load_settings(env={"TRAIND_DATA__PATHS": '["/a", "/b"]', "TRAIND_JOB__NAME": "123"})
    assert s.data.paths == [Path("/a"), Path("/b")]
    assert s.job.name == "123"


@pytest.mark.parametrize(
    ("env", "overrides", "expected"),
    [
        ({"TRAIND_JOB__STEPS": "-1"}, [], "job.steps: Input should be greater than 0"),
        ({}, ["optim.lr=fast"], "optim.lr: Input should be a valid number"),
        ({}, ["model.n_heads=3"], "n_heads (3) must divide d_model (128)"),
        ({}, ["precision.mode=fp9"], "precision.mode: Input should be 'fp32', 'bf16', 'fp16'"),
        ({}, ["daemon.port=70000"], "daemon.port: Input should be less than or equal to 65535"),
        ({"TRAIND_MODEL__WIDTH": "3"}, [], "model.width: unknown key"),
        ({}, ["nonsense.key=1"], "nonsense: unknown key"),
        ({}, ["job.steps"], "expected key.path=value"),
        ({}, ["job.nnodes=2"], "rdzv_endpoint (host:port) is required when nnodes > 1"),
        ({}, ["precision.snr_low=50"], "snr_low (50.0) must be below snr_high"),
        ({}, ["parallel.strategy=tp"], "parallel.strategy: Input should be 'ddp', 'zero1'"),
        ({}, ["compression.topk_ratio=0"], "compression.topk_ratio: Input should be greater"),
        ({}, ["job.steps.deeper=1"], "job.steps: Input should be a valid integer"),
    ],
)
def test_errors_name_the_field_and_reason(env, overrides, expected):
    with pytest.raises(ConfigError) as exc:
        load_settings(env=env, overrides=overrides)
    assert expected in str(exc.value)


def test_unknown_key_in_toml_is_an_error(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("[job]\nstpes = 10\n")
    with pytest.raises(ConfigError, match=r"job\.stpes: unknown key"):
        load_settings(f, env={})


def test_bad_toml_and_missing_file(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text("[job\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(f, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", env={})


def test_several_errors_reported_together():
    with pytest.raises(ConfigError) as exc:
        load_settings(env={}, overrides=["job.steps=0", "job.batch_size=0"])
    assert "job.steps" in str(exc.value) and "job.batch_size" in str(exc.value)


def test_arm_errors_name_the_arm_and_field_without_the_whole_tree():
    with pytest.raises(ConfigError) as exc:
        load_settings(env={}, overrides=[
            'interleave.arms=[{"name":"A"},{"name":"B","compression":{"method":"int9"}}]'])
    text = str(exc.value)
    assert "interleave.arms.1.compression.method: Input should be" in text
    assert "'job'" not in text  # not the whole tree back at the user


def test_a_config_error_keeps_every_loc_pydantic_gave():
    with pytest.raises(ConfigError) as exc:
        load_settings(env={}, overrides=["job.steps=0", "job.batch_size=x", "job.stpes=1",
                                         "daemon.port=70000"])
    assert [loc for loc, _ in exc.value.errors] == [
        ("job", "steps"), ("job", "batch_size"), ("job", "stpes"), ("daemon", "port")]
    assert dict(exc.value.errors)[("job", "stpes")] == "unknown key"
    # the text is built from the same pairs, in the same words as before
    assert str(exc.value).startswith("invalid config:\n  job.steps: Input should be greater "
                                     "than 0 (got '0')\n  job.batch_size: ")


def test_a_model_check_below_its_model_keeps_the_path_it_names():
    arms = [{"name": "A"}, {"name": "B", "compression": {"method": "int9", "powersgd_rank": 0}}]
    with pytest.raises(ConfigError) as exc:
        validate({"interleave": {"arms": arms}})
    assert [loc for loc, _ in exc.value.errors] == [
        ("interleave", "arms", 1, "compression", "method"),
        ("interleave", "arms", 1, "compression", "powersgd_rank")]
    assert "\n  interleave.arms.1.compression.powersgd_rank: Input should be" in str(exc.value)


def test_runs_share_the_daemons_corpus_cache_unless_the_config_names_one(tmp_path: Path) -> None:
    from traind.daemon.config import corpus_cache_dir, train_config

    settings = load_settings(env={})
    cfg = train_config(settings, default_out_dir=tmp_path / "run",
                       default_cache_dir=corpus_cache_dir(tmp_path))
    assert cfg.data.cache_dir == tmp_path / "cache" / "corpus"
    assert cfg.job.out_dir == tmp_path / "run"
    own = load_settings(env={}, overrides=[f"data.cache_dir={tmp_path / 'mine'}"])
    cfg = train_config(own, default_out_dir=tmp_path, default_cache_dir=tmp_path / "x")
    assert cfg.data.cache_dir == tmp_path / "mine"


@pytest.mark.parametrize(("tree", "path"), [
    ({"job": {"steps": True}}, "job.steps"),
    ({"job": {"nproc_per_node": False}}, "job.nproc_per_node"),
    ({"optim": {"lr": float("inf")}}, "optim.lr"),
    ({"optim": {"lr": float("nan")}}, "optim.lr"),
    ({"compression": {"topk_ratio": float("-inf")}}, "compression.topk_ratio"),
    ({"job": {"steps": 2**63}}, "job.steps"),
    ({"job": {"seed": 10**30}}, "job.seed"),
])
def test_a_boolean_or_a_non_finite_number_is_refused_naming_the_field(
        tree: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(path)):
        validate(tree)
