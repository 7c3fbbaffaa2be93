"""No file-system path from a web user: a forked experiment's checkpoint is named by ids that the
daemon resolves under its state folder, and overrides cannot set a Path-typed config field.

The real node behind the real app (no job is started: every request here is refused, or only
resolved), plus ``traind experiments submit`` sending the ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel
from typer.testing import CliRunner

from tests.web.conftest import TOKEN, FakeService, LiveServer
from traind.cli.experiments import experiments_app
from traind.daemon.config import load_settings
from traind.daemon.db import crud
from traind.daemon.experiments.specs import path_fields, refuse_paths, starting_checkpoint
from traind.daemon.node import Node
from traind.daemon.service import ExperimentSpec
from traind.trainer.config import TrainConfig
from traind.web.app import create_app

if TYPE_CHECKING:
    from collections.abc import Iterator

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ARMS = [{"name": "fp32", "precision": "fp32"}, {"name": "bf16", "precision": "bf16"}]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    node = Node(load_settings(env={}, overrides=[
        f"daemon.var_dir={tmp_path / 'var'}", "daemon.default_job=false", "job.threads=1"]))
    node.migrate()
    node.service.check_token = lambda token: token == TOKEN  # type: ignore[method-assign]
    return node


@pytest.fixture
def client(node: Node) -> Iterator[TestClient]:
    with TestClient(create_app(node.service, allowed_hosts=["testserver"])) as c:
        yield c


def _run_with_checkpoint(node: Node, step: int) -> int:
    """A run the node knows, with a (dummy) checkpoint file where the daemon puts them."""
    run_id = crud.create_run(node.engine, name="base", config={})
    folder = node.var_dir / "runs" / str(run_id)
    folder.mkdir(parents=True)
    (folder / f"step_{step:08d}.pt").write_bytes(b"not loaded by these tests")
    return run_id


def _locs(r: Any) -> list[list[Any]]:
    return [item["loc"] for item in r.json()["detail"]]


def test_a_checkpoint_is_resolved_from_ids_under_the_state_folder(node: Node) -> None:
    run_id = _run_with_checkpoint(node, 10)
    spec = ExperimentSpec(name="f", arms=tuple(ARMS), steps=5, mode="forked",
                          checkpoint_run=run_id, checkpoint_step=10)
    found = starting_checkpoint(node.settings, spec, run_known=True)
    assert found == (node.var_dir / "runs" / str(run_id) / "step_00000010.pt").resolve()
    assert starting_checkpoint(node.settings, ExperimentSpec(name="f", arms=(), steps=5),
                               run_known=False) is None


def test_a_link_out_of_the_run_folder_is_refused(node: Node, tmp_path: Path) -> None:
    run_id = _run_with_checkpoint(node, 10)
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"x")
    os.symlink(outside, node.var_dir / "runs" / str(run_id) / "step_00000020.pt")
    spec = ExperimentSpec(name="f", arms=tuple(ARMS), steps=5, mode="forked",
                          checkpoint_run=run_id, checkpoint_step=20)
    with pytest.raises(ValueError, match="checkpoint_step"):
        starting_checkpoint(node.settings, spec, run_known=True)


@pytest.mark.parametrize(("extra", "loc"), [
    ({"checkpoint": "/etc/passwd"}, ["body", "checkpoint"]),  # the old path field is gone
    ({"checkpoint_run": "../../etc", "checkpoint_step": 1}, ["body", "checkpoint_run"]),
    ({"checkpoint_run": 1}, ["body", "checkpoint_step"]),
    ({"checkpoint_run": 999, "checkpoint_step": 10}, ["body", "checkpoint_run"]),  # unknown
    ({"checkpoint_run": "KNOWN", "checkpoint_step": 11}, ["body", "checkpoint_step"]),
    ({"checkpoint_run": "KNOWN", "checkpoint_step": -1}, ["body", "checkpoint_step"]),
])
def test_a_forked_checkpoint_is_ids_of_a_known_run(
        client: TestClient, node: Node, extra: dict[str, Any], loc: list[Any]) -> None:
    known = _run_with_checkpoint(node, 10)
    extra = {k: known if v == "KNOWN" else v for k, v in extra.items()}
    body = {"name": "f", "steps": 5, "mode": "forked", "arms": ARMS, **extra}
    r = client.post("/api/experiments", json=body, headers=AUTH)
    assert r.status_code == 422 and loc in _locs(r), r.text
    assert node.service.experiments() == []
    assert [r.id for r in crud.list_runs(node.engine)] == [known]


@pytest.mark.parametrize(("overrides", "loc"), [
    ({"data.paths": ["/etc"]}, ["overrides", "data", "paths"]),
    ({"data.cache_dir": "/tmp/c"}, ["overrides", "data", "cache_dir"]),
    ({"job.out_dir": "/tmp/o"}, ["overrides", "job", "out_dir"]),
    ({"data": {"paths": ["/etc/shadow"]}}, ["overrides", "data", "paths"]),  # a whole section
    ({"job": {"name": "x", "out_dir": "/tmp"}}, ["overrides", "job", "out_dir"]),
    # the user's own model is an import; shards and tokenizers are files (issue 18)
    ({"model.factory": "os:system"}, ["overrides", "model", "factory"]),
    ({"model": {"factory": "evil.module:build"}}, ["overrides", "model", "factory"]),
    ({"data.shards": "/etc"}, ["overrides", "data", "shards"]),
    ({"data.tokenizer_file": "/etc/passwd"}, ["overrides", "data", "tokenizer_file"]),
])
@pytest.mark.parametrize("route", ["/api/experiments", "/api/autotunes"])
def test_overrides_cannot_set_a_path(client: TestClient, node: Node, route: str,
                                     overrides: dict[str, Any], loc: list[Any]) -> None:
    body: dict[str, Any] = {"name": "x", "steps": 20, "overrides": overrides}
    if route == "/api/experiments":
        body["arms"] = ARMS
    r = client.post(route, json=body, headers=AUTH)
    assert r.status_code == 422 and ["body", *loc] in _locs(r), r.text
    assert node.service.experiments() == [] and node.service.autotunes() == []
    assert crud.list_runs(node.engine) == []


def test_other_overrides_still_work(node: Node) -> None:
    refuse_paths({"model.n_layers": 2, "data": {"max_bytes": 10}, "job.name": "x"})


def test_path_fields_come_from_the_annotations() -> None:
    assert {"job.out_dir", "data.paths", "data.cache_dir", "data.shards", "data.tokenizer_file",
            "model.factory"} <= path_fields(TrainConfig)

    class Leaf(BaseModel):
        where: Path | None = None
        n: int = 0

    class Root(BaseModel):
        leaves: list[Leaf] = []
        files: dict[str, list[Path]] = {}
        name: str = ""

    assert path_fields(Root) == {"leaves.where", "files"}


def test_the_cli_sends_checkpoint_ids(tmp_path: Path) -> None:
    service = FakeService()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with LiveServer(create_app(service)) as server:
        r = CliRunner().invoke(experiments_app, [
            "submit", "--name", "f", "--arm", "fp32:precision=fp32", "--arm",
            "bf16:precision=bf16", "--steps", "5", "--mode", "forked",
            "--checkpoint-run", "3", "--checkpoint-step", "40", "--url", server.url,
            "--token-file", str(token)])
    assert r.exit_code == 0, r.output
    [spec] = service.specs
    assert (spec.checkpoint_run, spec.checkpoint_step) == (3, 40)
