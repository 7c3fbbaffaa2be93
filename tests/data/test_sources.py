"""Reading documents: folders, JSONL and Parquet fields, the default corpus."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from traind.data.sources import (
    SKIP_DIRS,
    default_corpus_files,
    documents,
    glob_regex,
    input_files,
)

if TYPE_CHECKING:
    from pathlib import Path


def test_folders_are_globbed_in_sorted_order(tmp_path: Path) -> None:
    for name in ("b.py", "a.py", "c.txt", "sub/d.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    assert [p.name for p in input_files([tmp_path])] == ["a.py", "b.py", "d.py"]
    assert [p.name for p in input_files([tmp_path], "*.txt")] == ["c.txt"]
    with pytest.raises(ValueError, match="no files match"):
        input_files([tmp_path], "*.md")
    with pytest.raises(ValueError, match="missing does not exist"):
        input_files([tmp_path / "missing"])


def test_default_corpus_is_the_stdlib_without_tests() -> None:
    files = default_corpus_files()
    assert len(files) > 100 and any(p.name == "os.py" for p in files)
    assert not any(SKIP_DIRS.intersection(p.parts) for p in files)


def test_jsonl_reads_the_text_field_and_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    docs = documents([path])
    assert next(docs) == (f"{path}:1", "héllo".encode())
    with pytest.raises(ValueError, match=rf"{path}:3: no string field 'text'"):
        next(docs)
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match=rf"{path}:1: not a JSON line"):
        list(documents([path]))


def test_parquet_reads_the_text_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["one", "twö"], "n": [1, 2]}), path)
    assert list(documents([path])) == [(f"{path}:0", b"one"), (f"{path}:1", "twö".encode())]
    with pytest.raises(ValueError, match=rf"{path}: no column 'body'"):
        list(documents([path], text_field="body"))
    with pytest.raises(ValueError, match=rf"{path}:0: column 'n' is not text"):
        list(documents([path], text_field="n"))


@pytest.mark.parametrize(("pattern", "path", "matches"), [
    ("**/*.py", "a.py", True), ("**/*.py", "x/y/a.py", True), ("**/*.py", "x/a.pyc", False),
    ("*.txt", "a.txt", True), ("*.txt", "d/a.txt", False), ("d/*.md", "d/a.md", True),
    ("d/*.md", "e/d/a.md", False), ("**", "any/where", True), ("a?.c", "ab.c", True),
    ("a?.c", "a/.c", False), ("a.c", "abc", False),
])
def test_the_glob_matches_as_path_glob_does(pattern: str, path: str, matches: bool) -> None:
    """The walk that replaced Path.glob (2.1 s of every job's start) keeps its matching."""
    assert bool(glob_regex(pattern).fullmatch(path)) is matches


@pytest.mark.parametrize("make", ["fifo", "device"])
def test_a_source_that_is_not_a_regular_file_says_so(tmp_path: Path, make: str) -> None:
    """Issue 40: /dev/zero and FIFOs were "does not exist" (and would never end if read)."""
    import os
    from pathlib import Path as P

    if make == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = P("/dev/zero")
    with pytest.raises(ValueError, match="is not a regular file or a folder"):
        input_files([path])
    with pytest.raises(ValueError, match="does not exist"):
        input_files([tmp_path / "nowhere"])


@pytest.mark.parametrize("text", [
    "x" * 50_000,  # one line, no newline: cut at the size bound
    ("a line of words\n" * 4000),  # lines: cut after a newline
    "\u00e9\u4e2d\U0001f600" * 6000,  # 2-, 3- and 4-byte characters, no newline
])
def test_a_long_file_is_read_in_pieces_that_keep_lines_and_characters_whole(
        tmp_path: Path, text: str) -> None:
    """Issue 40: a 210 MB file with no newline was one document (3.19 GB of RSS): past
    max_doc_bytes it is read, and analysed, a piece at a time."""
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    raw = path.read_bytes()
    limit = 4096
    docs = list(documents([path], max_doc_bytes=limit))
    assert len(docs) >= len(raw) // limit
    assert b"".join(d for _, d in docs) == raw
    assert all(0 < len(d) <= limit for _, d in docs)
    for where, d in docs:
        d.decode("utf-8")  # no piece splits a character
        assert where.startswith(f"{path}@")
        if "\n" in text:
            assert d.endswith(b"\n") or where == docs[-1][0]
    # a record of JSONL is cut the same way; a short file stays one document named by its path
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text(json.dumps({"text": text}) + "\n")
    assert b"".join(d for _, d in documents([jsonl], max_doc_bytes=limit)) == raw
    small = tmp_path / "small.txt"
    small.write_text("short")
    assert list(documents([small], max_doc_bytes=limit)) == [(str(small), b"short")]
