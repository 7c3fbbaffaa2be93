"""`traind experiments` against a real HTTP server: uvicorn in a thread serving the web app
around the web tests' fake service, driven through typer's CliRunner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner

from tests.web.conftest import TOKEN, FakeService, LiveServer, int8_verdict
from traind.cli.experiments import experiments_app, parse_arm, parse_compression
from traind.daemon.config import ConfigError
from traind.daemon.service import AutotuneSpec
from traind.web.app import create_app

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeService, str]]:
    service = FakeService()
    with LiveServer(create_app(service)) as server:
        yield service, server.url


@pytest.fixture
def server(served: tuple[FakeService, str]) -> tuple[FakeService, str]:
    service, url = served
    service.experiment_infos.clear()
    service.specs.clear()
    service.reject = None
    return service, url


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def cli(*args: str) -> Any:
    result = CliRunner().invoke(experiments_app, list(args), env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def submit_args(url: str, token_file: Path, *extra: str) -> list[str]:
    return ["submit", "--name", "int8-vs-none", "--arm", "none",
            "--arm", "int8:compression.method=int8", "--arm", "half:precision=bf16",
            "--steps", "400", "--block-steps", "10", "--set", "model.n_layers=2",
            "--url", url, "--token-file", str(token_file), *extra]


def test_submit_carries_the_bands_and_leaves_unset_ones_to_the_daemon(
        server: tuple[FakeService, str], token_file: Path) -> None:
    service, url = server
    r = cli(*submit_args(url, token_file, "--min-effect", "0.05", "--equivalence", "0.03",
                         "--loss-margin", "0.1"))
    assert r.exit_code == 0, r.output
    spec = service.specs[0]
    assert (spec.min_effect, spec.equivalence, spec.loss_margin) == (0.05, 0.03, 0.1)
    assert cli(*submit_args(url, token_file)).exit_code == 0
    spec = service.specs[1]
    # no band given: the daemon chooses it (daemon/experiments/bands.py)
    assert (spec.min_effect, spec.equivalence, spec.loss_margin) == (0.02, None, 0.05)
    r = cli(*submit_args(url, token_file, "--equivalence", "0"))  # the daemon's 422
    assert r.exit_code == 1 and "equivalence" in r.stderr and len(service.specs) == 2


def test_submit_list_show_cancel(server: tuple[FakeService, str], token_file: Path) -> None:
    service, url = server
    r = cli(*submit_args(url, token_file))
    assert r.exit_code == 0, r.output
    assert "experiment 1 int8-vs-none queued: none vs int8 vs half (run 101)" in r.stdout
    assert f"{url}/experiments/1" in r.stdout
    spec = service.specs[0]
    assert spec.steps == 400 and spec.block_steps == 10
    assert spec.overrides == {"model.n_layers": "2"}
    assert spec.arms == (
        {"name": "none", "compression": {}, "precision": None},
        {"name": "int8", "compression": {"method": "int8"}, "precision": None},
        {"name": "half", "compression": {}, "precision": "bf16"},
    )

    r = cli("list", "--url", url)
    assert r.exit_code == 0 and "int8-vs-none" in r.stdout and "queued" in r.stdout

    service.finish(1, int8_verdict())
    r = cli("show", "1", "--url", url)
    assert r.exit_code == 0, r.output
    for text in ("int8-vs-none", "done", "better", "1.183", "1.121", "1.248", "0.0012",
                 "int8 is 1.183x faster than none", "pending"):
        assert text in r.stdout, text

    r = cli("cancel", "1", "--url", url, "--token", TOKEN)
    assert r.exit_code == 1 and "experiment 1 has already ended" in r.stderr


def test_cancel_a_queued_one(server: tuple[FakeService, str], token_file: Path) -> None:
    service, url = server
    cli(*submit_args(url, token_file))
    r = cli("cancel", "1", "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 0 and "experiment 1 int8-vs-none: cancelled" in r.stdout
    assert service.experiment(1).state == "cancelled"


def test_list_when_empty(server: tuple[FakeService, str]) -> None:
    r = cli("list", "--url", server[1])
    assert r.exit_code == 0 and "no experiments yet" in r.stdout


def test_no_daemon(tmp_path: Path, token_file: Path) -> None:
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    r = cli("list", "--url", url)
    assert r.exit_code == 1 and f"no daemon at {url}" in r.stderr


def test_wrong_token_is_rejected(server: tuple[FakeService, str], tmp_path: Path) -> None:
    service, url = server
    r = cli(*submit_args(url, tmp_path / "token", "--token", "nope"))
    assert r.exit_code == 1 and "token rejected: pass --token or --token-file" in r.stderr
    assert service.specs == []


def test_missing_token_file(server: tuple[FakeService, str], tmp_path: Path) -> None:
    service, url = server
    r = cli(*submit_args(url, tmp_path / "absent"))
    assert r.exit_code == 1 and "absent does not exist" in r.stderr
    assert "--token" in r.stderr and service.specs == []


def test_422_lists_each_field(server: tuple[FakeService, str], token_file: Path) -> None:
    service, url = server
    service.reject = ConfigError([
        (("interleave", "arms", 1, "compression", "method"), "unknown 'int9'"),
        (("model", "n_layers"), "Input should be greater than 0")])
    r = cli(*submit_args(url, token_file))
    assert r.exit_code == 1
    assert "interleave.arms.1.compression.method: unknown 'int9'" in r.stderr
    assert "model.n_layers: Input should be greater than 0" in r.stderr
    assert service.specs == []


def test_api_side_validation_is_shown_too(
    server: tuple[FakeService, str], token_file: Path
) -> None:
    url = server[1]
    r = cli("submit", "--name", "x", "--arm", "a", "--arm", "b:precision=fp8", "--steps", "0",
            "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 1
    assert "steps: Input should be greater than 0" in r.stderr
    assert "arms.1.precision: Input should be 'fp32', 'bf16' or 'fp16'" in r.stderr


def test_show_missing_is_an_error(server: tuple[FakeService, str]) -> None:
    r = cli("show", "9", "--url", server[1])
    assert r.exit_code == 1 and "no experiment 9" in r.stderr


def test_one_arm_is_a_usage_error(server: tuple[FakeService, str], token_file: Path) -> None:
    r = cli("submit", "--name", "x", "--arm", "a", "--steps", "10", "--url", server[1],
            "--token-file", str(token_file))
    assert r.exit_code == 2 and "at least two --arm" in r.output
    assert server[0].specs == []


@pytest.mark.parametrize(("text", "arm"), [
    ("a", {"name": "a", "compression": {}, "precision": None}),
    ("t:compression.method=topk, compression.topk_ratio=0.05",
     {"name": "t", "compression": {"method": "topk", "topk_ratio": "0.05"}, "precision": None}),
    ("p:precision=bf16,compression.method=powersgd",
     {"name": "p", "compression": {"method": "powersgd"}, "precision": "bf16"}),
])
def test_parse_arm(text: str, arm: dict[str, Any]) -> None:
    assert parse_arm(text) == arm


@pytest.mark.parametrize("text", [":precision=bf16", "a:method=int8", "a:precision"])
def test_parse_arm_rejects(text: str) -> None:
    import typer

    with pytest.raises(typer.BadParameter):
        parse_arm(text)


# --- auto-tuning and the queue ----------------------------------------------------------------


@pytest.fixture
def tuned(server: tuple[FakeService, str]) -> tuple[FakeService, str]:
    service, url = server
    service.autotune_infos.clear()
    service.tune_specs.clear()
    service.tune_reject = None
    service.promotion_views = []
    service.trials = []
    return service, url


def autotune_args(url: str, token_file: Path, *extra: str) -> list[str]:
    return ["autotune", "--name", "tune-small", "--precision", "fp32", "--precision", "bf16",
            "--precision", "fp8", "--compression", "none",
            "--compression", "powersgd:powersgd_rank=4", "--steps", "200", "--target-run", "3",
            "--url", url, "--token-file", str(token_file), *extra]


def test_autotune_submit_list_show_cancel(
    tuned: tuple[FakeService, str], token_file: Path
) -> None:
    service, url = tuned
    r = cli(*autotune_args(url, token_file, "--quality-steps", "50", "--quality-repeats", "3",
                           "--min-effect", "0.05"))
    assert r.exit_code == 0, r.output
    assert "auto-tune 1 tune-small running, promoting into run 3" in r.stdout
    assert "left out fp8.none: fp8 cannot switch inside a running job" in r.stdout
    assert f"{url}/autotunes/1" in r.stdout
    spec = service.tune_specs[0]
    assert spec.precisions == ("fp32", "bf16", "fp8") and spec.steps == 200
    assert spec.compressions == ({"method": "none"},
                                 {"method": "powersgd", "powersgd_rank": "4"})
    assert spec.target_run_id == 3 and spec.max_rounds == 3
    assert (spec.quality_steps, spec.quality_repeats, spec.min_effect) == (50, 3, 0.05)
    assert spec.equivalence == AutotuneSpec(name="x").equivalence  # unset: the default

    r = cli("autotunes", "--url", url)
    assert r.exit_code == 0 and "tune-small" in r.stdout and "running" in r.stdout

    r = cli("autotune-show", "1", "--url", url)
    assert r.exit_code == 0, r.output
    assert "Best so far" in r.stdout and "bf16 \u00b7 none: running" in r.stdout

    r = cli("autotune-cancel", "1", "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 0 and "auto-tune 1 tune-small: cancelled" in r.stdout
    r = cli("autotune-cancel", "1", "--url", url, "--token", TOKEN)
    assert r.exit_code == 1 and "auto-tune search 1 has already ended" in r.stderr


def test_autotune_show_a_finished_search(tuned: tuple[FakeService, str]) -> None:
    from tests.web.conftest import finished_autotune, sample_promotions

    service, url = tuned
    service.autotune_infos[7] = finished_autotune()
    service.promotion_views = sample_promotions(3)
    r = cli("autotune-show", "7", "--url", url)
    assert r.exit_code == 0, r.output
    for text in ("tune-small", "done", "bf16 \u00b7 int8", "bf16.int8: better 1.183",
                 "[1.121, 1.248]", "bf16.topk: rejected (quality)",
                 "no verdicts (its experiment failed)", "precision (quality, forked)",
                 "quality non-inferior",
                 "left out fp8.none: fp8 needs a GPU",
                 "promotion 2 kept at step 1400: bf16 \u00b7 int8 (was fp32 \u00b7 none)",
                 "(loss spike: 7.9 against a median of 3.2)"):
        assert text in r.stdout, text


def test_autotune_show_names_a_mesh_winner_and_what_to_start(
        tuned: tuple[FakeService, str]) -> None:
    import dataclasses

    from tests.web.conftest import finished_autotune

    service, url = tuned
    service.autotune_infos[8] = dataclasses.replace(finished_autotune(), best={
        "precision": "fp32", "compression": {"method": "none"},
        "mesh": {"parallel.dp": 1, "parallel.tp": 2, "parallel.pp": 1},
        "needs_restart": "a job builds its mesh when it starts: start one with parallel.tp=2"})
    r = cli("autotune-show", "8", "--url", url)
    assert r.exit_code == 0, r.output
    assert "mesh dp 1 \u00d7 tp 2 \u00d7 pp 1" in r.stdout
    assert "Not promoted" in r.stdout and "start one with parallel.tp=2" in r.stdout


def test_autotune_errors_name_the_fields(tuned: tuple[FakeService, str], token_file: Path) -> None:
    service, url = tuned
    service.tune_reject = ConfigError.at(("compression", "powersgd_rank"),
                                         "must be >= 1").within("fp32.powersgd-rank4")
    r = cli(*autotune_args(url, token_file))
    assert r.exit_code == 1 and "invalid auto-tune search:" in r.stderr
    assert "fp32.powersgd-rank4.compression.powersgd_rank: must be >= 1" in r.stderr
    service.tune_reject = None
    r = cli(*autotune_args(url, token_file, "--precision", "fp9", "--steps", "0"))
    assert r.exit_code == 1
    assert "precisions.3: Input should be" in r.stderr and "steps: Input should be" in r.stderr
    assert service.tune_specs == []
    r = cli(*autotune_args(url, token_file, "--token", "nope"))
    assert r.exit_code == 1 and "token rejected" in r.stderr


def test_autotune_defaults_and_empty_list(
    tuned: tuple[FakeService, str], token_file: Path
) -> None:
    service, url = tuned
    assert "no auto-tune searches yet" in cli("autotunes", "--url", url).stdout
    r = cli("autotune", "--name", "d", "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 0, r.output
    spec = service.tune_specs[0]
    assert spec.precisions == ("fp32", "bf16") and spec.target_run_id is None
    assert spec.compressions == ({"method": "none"}, {"method": "int8"}) and not spec.mesh
    r = cli("autotune", "--name", "m", "--mesh", "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 0 and service.tune_specs[1].mesh, r.output
    assert cli("autotune-show", "9", "--url", url).stderr.count("no auto-tune search 9") == 1


def test_queue_and_reorder(tuned: tuple[FakeService, str], token_file: Path) -> None:
    from tests.web.conftest import sample_trials

    service, url = tuned
    assert "no trials waiting" in cli("queue", "--url", url).stdout
    service.trials = sample_trials()
    r = cli("queue", "--url", url)
    assert r.exit_code == 0 and "forked-bf16" in r.stdout
    r = cli("reorder", "23", "21", "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 0, r.output
    assert [t.id for t in service.trials] == [23, 22, 21]
    r = cli("reorder", "21", "99", "--url", url, "--token-file", str(token_file))
    assert r.exit_code == 1 and "invalid order:" in r.stderr
    assert "trial_ids: not waiting trials: [99]" in r.stderr
    assert [t.id for t in service.trials] == [23, 22, 21]


@pytest.mark.parametrize(("text", "table"), [
    ("int8", {"method": "int8"}),
    ("powersgd:powersgd_rank=4", {"method": "powersgd", "powersgd_rank": "4"}),
    ("topk: compression.topk_ratio=0.01, topk_error_feedback=true",
     {"method": "topk", "topk_ratio": "0.01", "topk_error_feedback": "true"}),
])
def test_parse_compression(text: str, table: dict[str, Any]) -> None:
    assert parse_compression(text) == table


@pytest.mark.parametrize("text", [":powersgd_rank=4", "powersgd:rank", "int8:method=topk"])
def test_parse_compression_rejects(text: str) -> None:
    import typer

    with pytest.raises(typer.BadParameter):
        parse_compression(text)


def test_an_install_hint_keeps_its_brackets(tuned: tuple[FakeService, str]) -> None:
    """Issue 41: the fp8 hint printed `pip install 'traind'`: rich read [fp8] as a tag."""
    from dataclasses import replace

    from tests.web.conftest import finished_autotune

    service, url = tuned
    hint = "torchao is not installed: pip install 'traind[fp8]' (or torchao)"
    service.autotune_infos[7] = replace(finished_autotune(), infeasible=[
        {"candidate": "fp8.none", "reason": hint}])
    r = cli("autotune-show", "7", "--url", url)
    assert r.exit_code == 0, r.output
    assert f"left out fp8.none: {hint}" in " ".join(r.stdout.split())
