"""`traind experiments` against a real HTTP server: uvicorn in a thread serving the web app
around the web tests' fake service, driven through typer's CliRunner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.web.conftest import TOKEN, FakeService, LiveServer, int8_verdict
from traind.daemon.experiments_cli import experiments_app, parse_arm
from traind.web.app import create_app


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
    service.reject = ("invalid config:\n  interleave.arms.1.compression.method: unknown 'int9'\n"
                      "  model.n_layers: Input should be greater than 0")
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
