"""``traind data prepare`` and ``traind data tokenizer train`` end to end, through typer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

from traind.cli.main import app
from traind.data.manifest import read_manifest

if TYPE_CHECKING:
    from pathlib import Path

    from click.testing import Result


def cli(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_prepare_and_tokenizer_train(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    folder, _ = corpus
    r = cli("data", "prepare", folder, "--out", tmp_path / "bytes", "--shard-tokens", 2000,
            "--set", "data.glob=*.txt", "--val-fraction", 0.2)
    assert r.exit_code == 0, r.output
    assert "near_duplicate" in r.stdout and "tokens/s" in r.stdout
    assert read_manifest(tmp_path / "bytes").tokenizer.kind == "bytes"

    r = cli("data", "tokenizer", "train", folder, "--vocab", 300, "--out", tmp_path / "t.json",
            "--set", "data.glob=*.txt")
    assert r.exit_code == 0, r.output
    r = cli("data", "prepare", folder, "--out", tmp_path / "bpe", "--tokenizer", "bpe",
            "--tokenizer-file", tmp_path / "t.json", "--set", "data.glob=*.txt",
            "--val-fraction", 0.2, "--workers", 2)
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "bpe")
    assert (m.tokenizer.kind, m.tokenizer.file) == ("bpe", "tokenizer.json")
    assert m.tokenizer.vocab_size <= 300


@pytest.mark.parametrize(("args", "named"), [
    (["--val-fraction", "0.9"], "data.val_fraction"),
    (["--tokenizer", "words"], "data.tokenizer"),
    (["--tokenizer", "bpe"], "data.tokenizer_file"),
    (["--tokenizer", "bpe", "--tokenizer-file", "missing.json"], "missing.json"),
    (["--set", "data.filter.min_entropy=-1"], "data.filter.min_entropy"),
    (["--shard-tokens", "0"], "--shard-tokens"),
    (["--vocab", "10", "--tokenizer", "bpe"], "--vocab"),
])
def test_bad_options_exit_2_naming_the_field(corpus: tuple[Path, list[str]], tmp_path: Path,
                                             args: list[str], named: str) -> None:
    folder, _ = corpus
    r = cli("data", "prepare", folder, "--out", tmp_path / "out", *args)
    assert r.exit_code == 2, r.output
    assert named in r.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_missing_source_and_changed_arguments(corpus: tuple[Path, list[str]],
                                                tmp_path: Path) -> None:
    folder, _ = corpus
    r = cli("data", "prepare", tmp_path / "nowhere", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "nowhere does not exist" in r.output
    base = ["data", "prepare", folder, "--out", tmp_path / "o", "--set", "data.glob=*.txt",
            "--val-fraction", 0.2]
    assert cli(*base).exit_code == 0
    r = cli(*base, "--shard-tokens", 100)
    assert r.exit_code == 2 and "--force" in r.output
    assert cli(*base, "--shard-tokens", 100, "--force").exit_code == 0
