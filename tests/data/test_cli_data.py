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


def test_a_folder_the_glob_mostly_skips_is_named_with_what_it_holds(tmp_path: Path) -> None:
    """Issue 41: a folder of documentation under the default glob (``**/*.py``) silently
    kept its few .py files and failed with "the val split is empty", naming no glob."""
    from tests.data.conftest import real_doc

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"tool{i}.py").write_text(real_doc(i))
    for i in range(20):
        (docs / f"page{i}.txt").write_text(real_doc(100 + i))
    r = cli("data", "prepare", docs, "--out", tmp_path / "out")
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "data.glob '**/*.py' takes 3 of 23 files (.py 3)" in out, out
    assert "warning: data.glob '**/*.py' skips most of" in out and ".txt 20" in out, out
    assert "(data.glob '**/*.py' took 3 files from the folders)" in out, out
    # the glob the warning names takes them all
    r = cli("data", "prepare", docs, "--out", tmp_path / "all", "--set", "data.glob=**/*",
            "--val-fraction", "0.3")
    assert r.exit_code == 0, r.output
    assert "takes 23 of 23 files (.txt 20, .py 3)" in " ".join(r.output.split())
    assert "warning" not in r.output
