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
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from traind.extras import require

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

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


# A folder's glob that takes under this share of its files is said to have skipped most of it.
MOSTLY_SKIPPED = 0.5


def _by_extension(paths: Iterable[Path]) -> Counter[str]:
    return Counter(p.suffix.lower() or "(none)" for p in paths)


def _counts(c: Counter[str], most: int = 5) -> str:
    shown = ", ".join(f"{ext} {n:,}" for ext, n in c.most_common(most))
    rest = sum(c.values()) - sum(n for _, n in c.most_common(most))
    return shown + (f", others {rest:,}" if rest else "")


def census(sources: Sequence[Path], glob: str) -> list[str]:
    """What each source folder gave, in words a preparation prints before it reads: the
    files ``glob`` took by extension, and a warning naming the glob when it took under half
    of the folder's files (a folder of documentation under the default ``**/*.py``)."""
    out = []
    for folder in sources:
        if not folder.is_dir():
            continue
        took = inside(folder, glob)
        every = inside(folder, "**/*")
        line = f"{folder}: data.glob {glob!r} takes {len(took):,} of {len(every):,} files"
        out.append(line + (f" ({_counts(_by_extension(took))})" if took else ""))
        if every and len(took) < MOSTLY_SKIPPED * len(every):
            skipped = _by_extension(set(every) - set(took))
            out.append(f"warning: data.glob {glob!r} skips most of {folder} ({_counts(skipped)}"
                       f"); to take them: --set data.glob='**/*' (or a pattern of your own)")
    return out


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
        elif path.exists():  # /dev/zero, a FIFO, a socket: never read to their end
            raise ValueError(f"{path} is not a regular file or a folder")
        else:
            raise ValueError(f"{path} does not exist")
    return files


# The largest document the preparation holds at once: a text file (or a record) past it is
# read and analysed in pieces of at most this many bytes. Memory follows the biggest
# document (its MinHash shingles and scores take ~15x its size), so one 210 MB line would
# otherwise take 3 GB.
MAX_DOC_BYTES = 4 * 2**20


def cut(data: bytes, limit: int) -> int:
    """Where a piece of ``data`` longer than ``limit`` ends: after its last newline in the
    piece's second half (documents stay whole lines), else at ``limit`` moved back to the
    start of a UTF-8 character (a piece never splits one)."""
    newline = data.rfind(b"\n", limit // 2, limit)
    if newline >= 0:
        return newline + 1
    at = limit
    while at > limit - 3 and 0x80 <= data[at] < 0xC0:  # a continuation byte: step back
        at -= 1
    return at


def pieces(where: str, raw: bytes, limit: int) -> Iterator[tuple[str, bytes]]:
    """``raw`` as documents of at most ``limit`` bytes: itself when it fits, else pieces
    named ``where@offset``."""
    if len(raw) <= limit:
        yield where, raw
        return
    at = 0
    while len(raw) - at > limit:
        n = cut(raw[at:at + limit + 1], limit)
        yield f"{where}@{at}", raw[at:at + n]
        at += n
    yield f"{where}@{at}", raw[at:]


def text_documents(path: Path, limit: int) -> Iterator[tuple[str, bytes]]:
    """A text file as one document, or as pieces of at most ``limit`` bytes (read a piece
    at a time: a file far larger than memory is fine)."""
    with path.open("rb") as f:
        data = f.read(limit + 1)
        if len(data) <= limit:
            yield str(path), data
            return
        at = 0
        while len(data) > limit:
            n = cut(data, limit)
            yield f"{path}@{at}", data[:n]
            at += n
            data = data[n:] + f.read(limit + 1 - (len(data) - n))
        yield f"{path}@{at}", data


def piece_count(path: Path, limit: int) -> int:
    """The fewest documents a text file becomes (pieces end at most ``limit`` bytes on)."""
    return max(1, -(-path.stat().st_size // limit))


def documents(files: Sequence[Path], *, text_field: str = "text",
              max_doc_bytes: int = MAX_DOC_BYTES) -> Iterator[tuple[str, bytes]]:
    """Every document of ``files``: ``(where, UTF-8 bytes)``; where is the path, or
    ``path:line`` (JSONL) and ``path:row`` (Parquet), with ``@offset`` for the pieces of one
    longer than ``max_doc_bytes``."""
    for path in files:
        kind = kind_of(path)
        if kind == "text":
            yield from text_documents(path, max_doc_bytes)
            continue
        records = (jsonl_documents(path, text_field) if kind == "jsonl"
                   else parquet_documents(path, text_field))
        for where, raw in records:
            yield from pieces(where, raw, max_doc_bytes)


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
