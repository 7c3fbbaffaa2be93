"""Where documents come from: text files, folders of them, JSONL and Parquet files, or the
default corpus (the Python standard library's own source, the same files as the trainer's
byte corpus reads when ``data.paths`` is empty).

Reading is separate from deciding: :func:`documents` yields ``(where, bytes)`` in a fixed
order (sources as given, folders sorted), so a resumed preparation can skip the first ``n``.
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from traind.extras import require

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

# Folders left out of the default corpus: installed packages differ from machine to machine
# (the default must be the same bytes everywhere for one Python version), and the test suites
# are large and repetitive. The trainer reads its corpus through this listing too.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
DEFAULT_GLOB = "**/*.py"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def glob_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` (a glob over ``/``-separated relative paths: ``**/`` any folders or none,
    ``*`` and ``?`` within one name) as a regular expression to ``fullmatch``."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            c = pattern[i]
            out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
            i += 1
    return re.compile("".join(out))


def inside(root: Path, pattern: str, skip: frozenset[str] = frozenset()) -> list[Path]:
    """The files under ``root`` matching ``pattern`` whose real path stays under ``root``,
    in no set order; folders named in ``skip`` are not entered, nor are symlinked ones.

    A walk that prunes, not ``Path.glob``: globbing the whole standard library and resolving
    every path to drop its site-packages and tests took 2.1 s of every job's start."""
    real, match = root.resolve(), glob_regex(pattern).fullmatch
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = Path(folder).relative_to(root)
        for name in files:
            path = Path(folder, name)
            if (match((rel / name).as_posix()) and path.is_file()
                    and (not path.is_symlink() or path.resolve().is_relative_to(real))):
                found.append(path)
    return found


def default_corpus_files(glob: str = DEFAULT_GLOB) -> list[Path]:
    """The standard library's source files, sorted, test suites and installed packages out."""
    return sorted(inside(stdlib_root(), glob, SKIP_DIRS))


def kind_of(path: Path) -> str:
    """How a file is read: ``jsonl``, ``parquet`` or ``text`` (each file one document)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def input_files(sources: Sequence[Path], glob: str = DEFAULT_GLOB) -> list[Path]:
    """The files of ``sources`` in order (folders: their ``glob`` matches, sorted); none given:
    the default corpus. A missing source or an empty folder is a ``ValueError``."""
    if not sources:
        return default_corpus_files(glob)
    files: list[Path] = []
    for path in sources:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(inside(path, glob))
            if not found:
                raise ValueError(f"{path}: no files match the glob {glob!r}")
            files.extend(found)
        else:
            raise ValueError(f"{path} does not exist")
    return files


def documents(files: Sequence[Path], *, text_field: str = "text"
              ) -> Iterator[tuple[str, bytes]]:
    """Every document of ``files``: ``(where, UTF-8 bytes)``; where is the path, or
    ``path:line`` (JSONL) and ``path:row`` (Parquet)."""
    for path in files:
        kind = kind_of(path)
        if kind == "jsonl":
            yield from jsonl_documents(path, text_field)
        elif kind == "parquet":
            yield from parquet_documents(path, text_field)
        else:
            yield str(path), path.read_bytes()


def jsonl_documents(path: Path, field: str) -> Iterator[tuple[str, bytes]]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not a JSON line ({exc})") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{where}: no string field {field!r} (--text-field)")
            yield where, text.encode("utf-8", "surrogatepass")


def parquet_documents(path: Path, column: str) -> Iterator[tuple[str, bytes]]:
    pq = require("pyarrow.parquet")
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own error types
        raise ValueError(f"{path}: not a Parquet file ({exc})") from None
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {column!r} (--text-field); it has "
                         f"{', '.join(pf.schema_arrow.names)}")
    row = 0
    for batch in pf.iter_batches(columns=[column]):
        for text in batch.column(0).to_pylist():
            where = f"{path}:{row}"
            row += 1
            if not isinstance(text, str):
                raise ValueError(f"{where}: column {column!r} is not text ({text!r:.40})")
            yield where, text.encode("utf-8", "surrogatepass")
