"""The `traind` command as a user types it."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import create_engine, inspect

if TYPE_CHECKING:
    from pathlib import Path

TRAIND = [sys.executable, "-m", "traind.cli.main"]


def traind(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIND_")}
    env["COLUMNS"] = "160"
    return subprocess.run([*TRAIND, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_version(tmp_path: Path):
    r = traind("version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("traind ")
    assert "torch 2.13.0" in r.stdout


def test_help_lists_the_commands(tmp_path: Path):
    r = traind("--help", cwd=tmp_path)
    for cmd in ("serve", "run", "db", "version"):
        assert cmd in r.stdout


def test_bad_config_names_the_field_and_exits_2(tmp_path: Path):
    (tmp_path / "c.toml").write_text("[job]\nsteps = -5\n[model]\nwidht = 3\n")
    r = traind("run", "c.toml", cwd=tmp_path)
    assert r.returncode == 2
    assert "job.steps: Input should be greater than 0" in r.stderr
    assert "model.widht: unknown key" in r.stderr
    assert not (tmp_path / "var").exists()  # nothing half-made


def test_db_upgrade_creates_the_schema(tmp_path: Path):
    r = traind("db", "upgrade", "--set", f"daemon.var_dir={tmp_path / 'state'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    engine = create_engine(f"sqlite:///{tmp_path / 'state' / 'traind.db'}")
    assert {"runs", "run_events", "alembic_version"} <= set(inspect(engine).get_table_names())


@pytest.mark.slow
def test_run_trains_in_the_foreground(tmp_path: Path):
    (tmp_path / "c.toml").write_text(
        "[job]\nname = 'fg'\nsteps = 30\neval_every = 15\neval_batches = 1\nthreads = 1\n"
        "batch_size = 4\nout_dir = 'out'\n"
        "[model]\nseq_len = 32\nd_model = 32\nn_layers = 1\nn_heads = 2\n"
        "[data]\nmax_bytes = 300000\n")
    r = traind("run", "c.toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fg: completed" in r.stderr
    assert any((tmp_path / "out").glob("step_*.pt"))
    # Run again with more steps: it resumes from the checkpoint at step 30.
    r = traind("run", "c.toml", "--set", "job.steps=40", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 30" in r.stderr


def test_cluster_submit_queues_one_slot_per_node(tmp_path: Path):
    from traind.daemon.db import queue
    from traind.daemon.db.engine import default_url, make_engine

    r = traind("cluster", "submit", "--set", "job.nnodes=3",
               "--set", "job.rdzv_endpoint=10.0.0.1:29400", "--set", "daemon.var_dir=var",
               cwd=tmp_path)
    assert r.returncode == 0 and "3 node slots" in r.stderr, r.stderr
    engine = make_engine(default_url(tmp_path / "var"))
    (view,) = queue.list_experiments(engine)
    assert view.mode == "multinode" and view.base_config["job"]["nnodes"] == 3
    assert [t.repeat for t in queue.list_trials(engine)] == [0, 1, 2]
    bad = traind("cluster", "submit", "--set", "daemon.var_dir=var", cwd=tmp_path)
    assert bad.returncode == 2 and "job.nnodes" in bad.stderr


def _one_line_exit_2(r: subprocess.CompletedProcess[str], *named: str) -> None:
    """Issue 40: `traind run` answers what it cannot run in one line naming the field, exit
    2, as `traind serve` does; never a traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    # one error line; an admission refusal lists its fields under it, indented
    first, *fields = [x for x in out.splitlines() if x.strip()]
    assert first.startswith("error: "), out
    assert len(fields) <= 2 and all(x.startswith("  ") for x in fields), out
    for name in named:
        assert name in out, out


@pytest.mark.parametrize("make", ["latin-1", "folder"])
def test_a_config_that_is_not_a_utf8_file_is_one_line(tmp_path: Path, make: str) -> None:
    path = tmp_path / "c.toml"
    if make == "folder":
        path.mkdir()
    else:
        path.write_bytes("[job]\nname = 'caf\u00e9'\n".encode("latin-1"))
    r = traind("run", "c.toml", cwd=tmp_path)
    _one_line_exit_2(r, "c.toml", "folder" if make == "folder" else "not UTF-8")


@pytest.mark.parametrize(("sets", "named"), [
    (["model.seq_len=9223372036854775807"], "model.seq_len"),
    (["job.batch_size=99999999999"], "job.batch_size"),
    (["data.shards=nowhere"], "data.shards"),
    (["data.tokenizer=bpe", "data.tokenizer_file=blob.json"], "data.tokenizer_file"),
    (["model.factory=broken_models:gpt"], "model.factory"),
])
def test_what_the_job_names_but_cannot_have_is_one_line(tmp_path: Path, sets: list[str],
                                                         named: str) -> None:
    (tmp_path / "blob.json").write_bytes(bytes(range(256)) * 4)  # a binary "tokenizer"
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('broken at import')\n")
    args = [a for s in sets for a in ("--set", s)]
    r = traind("run", *args, "--set", f"daemon.var_dir={tmp_path / 'var'}", cwd=tmp_path)
    _one_line_exit_2(r, named)


BOOM = '''
import os
from torch import nn

class Boom(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.e, self.o, self.n = nn.Embedding(vocab, 16), nn.Linear(16, vocab), 0

    def forward(self, idx):
        self.n += 1
        if self.n == 3 and os.environ.get("RANK") == "1" and os.environ.get("BOOM"):
            raise ValueError("the batch on rank 1 is cursed")
        return self.o(self.e(idx))

def boom(vocab_size):
    return Boom(vocab_size)
'''
TWO_RANKS = ("[job]\nname = 'two'\nsteps = 12\nthreads = 1\nbatch_size = 4\n"
             "nproc_per_node = 2\nout_dir = 'out'\n[model]\nseq_len = 32\n"
             "factory = 'boom:boom'\n[data]\nmax_bytes = 300000\n")


def _two_ranks(tmp_path: Path, *, boom: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "boom.py").write_text(BOOM)
    (tmp_path / "c.toml").write_text(TWO_RANKS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIND_")}
    env.update(COLUMNS="160", PYTHONPATH=str(tmp_path), **({"BOOM": "1"} if boom else {}))
    return subprocess.run([*TRAIND, "run", "c.toml", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_failed_rank_is_one_line_with_its_own_error(tmp_path: Path) -> None:
    """Issue 41: a worker's clear error was only in worker.log; the terminal showed torchrun's
    ChildFailedError traceback, and torchrun's "first observed failure" was often rank 0's
    gloo error about its peer, not the rank that failed."""
    r = _two_ranks(tmp_path, boom=True)
    assert r.returncode == 1
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, r.stderr[-3000:]
    assert "worker rank 1 " in error[0]
    assert "ValueError: the batch on rank 1 is cursed" in error[0]
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr
    report = json.loads(r.stdout)
    assert report["state"] == "failed" and "the batch on rank 1" in report["error"]
    assert "ChildFailedError" in (tmp_path / "out" / "worker.log").read_text()  # the log has it


@pytest.mark.slow
def test_two_ranks_report_the_lead_rank_and_write_its_history(tmp_path: Path) -> None:
    r = _two_ranks(tmp_path, boom=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    with open(tmp_path / "out" / "history.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [int(row["step"]) for row in rows if row["loss"]]
    assert steps == list(range(1, 13))  # the lead rank's, each once
    # The summary is rank 0's (it was whichever rank reported last), the history's last.
    assert report["summary"]["step"] == 12 and report["state"] == "completed"
    last = [row for row in rows if row["loss"]][-1]
    assert report["summary"]["loss"] == pytest.approx(float(last["loss"]))
    assert report["history"] == "out/history.csv"
