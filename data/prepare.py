"""``traind data prepare``: read the sources once, filter, split, tokenize, write shards.

Documents flow in stream order through batches: each batch is analysed (in a process pool
when ``workers`` > 1), decided one by one (:class:`~traind.data.filters.DocFilter`), split
by a hash of its content (deterministic, order-free), tokenized (one ``encode_batch`` call, in
Rust threads for the BPE; a view of the bytes for ``bytes``) and appended to its split's
pending tokens. Every ``shard_tokens`` tokens become a shard; after a batch that wrote one, the
progress is checkpointed (data/progress.py), so an interrupted run resumes at that batch.
The manifest is written last.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np

from traind.data import progress as ckpt
from traind.data.filters import REASONS, DocFilter, analyse
from traind.data.manifest import SPLITS, Manifest, dtype_for, read_manifest, write_manifest
from traind.data.shards import write_shard
from traind.data.sources import (
    DEFAULT_GLOB,
    MAX_DOC_BYTES,
    documents,
    input_files,
    kind_of,
    piece_count,
    stdlib_root,
)
from traind.data.tokenizer import TOKENIZER_FILE, BPETokenizer, Tokenizer, train_bpe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from pathlib import Path

    from rich.progress import Progress as Bar

    from traind.data.filters import Analysis
    from traind.trainer.config import FilterConfig

BATCH_DOCS = 256
BATCH_BYTES = 8 * 2**20


def is_val(digest: str, val_fraction: float) -> bool:
    """Whether the document with content hash ``digest`` is in the val split."""
    return int(digest[:16], 16) / 2**64 < val_fraction


def batches(docs: Iterable[tuple[str, bytes]]) -> Iterator[list[tuple[str, bytes]]]:
    batch: list[tuple[str, bytes]] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def prepare(sources: Sequence[Path], out: Path, *, filter_cfg: FilterConfig,
            tokenizer: Tokenizer | None = None, train_vocab: int | None = None,
            val_fraction: float = 0.05, shard_tokens: int = 2**24, min_doc_bytes: int = 16,
            glob: str = DEFAULT_GLOB, text_field: str = "text", workers: int = 1,
            force: bool = False, progress: bool = False, max_doc_bytes: int = MAX_DOC_BYTES,
            on_checkpoint: Callable[[ckpt.Progress], None] | None = None) -> Manifest:
    """Prepare ``sources`` (none: the default corpus) into ``out`` and return its manifest.

    ``tokenizer=None`` trains a BPE of ``train_vocab`` ids on the sources first (kept in
    ``out``, so a resumed run reuses it). ``on_checkpoint`` is called after each checkpoint
    (tests interrupt a run there). Resumes a run of the same arguments; refuses a folder
    holding anything else unless ``force``."""
    if tokenizer is None and train_vocab is None:
        raise ValueError("--vocab: a BPE tokenizer needs a file or a vocabulary size to train")
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens: must be positive, not {shard_tokens}")
    if not 0 < val_fraction < 0.5:
        raise ValueError(f"--val-fraction: must be in (0, 0.5), not {val_fraction}")
    if max_doc_bytes < 1024:
        raise ValueError(f"--max-doc-bytes: must be at least 1024, not {max_doc_bytes}")
    files = input_files(sources, glob)
    if all(kind_of(f) == "text" for f in files):
        try:
            check_splits(sum(piece_count(f, max_doc_bytes) for f in files), val_fraction)
        except ValueError as exc:
            if any(p.is_dir() for p in sources):  # what the folders gave: the glob chose
                raise ValueError(f"{exc} (data.glob {glob!r} took {len(files):,} "
                                 "files from the folders)") from None
            raise
    names = [str(p) for p in sources] or [f"{stdlib_root()} ({glob})"]
    args = {"sources": names, "glob": glob, "text_field": text_field,
            "tokenizer": tokenizer.hash if tokenizer else f"bpe trained at {train_vocab}",
            "filter": filter_cfg.model_dump(),
            "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "min_doc_bytes": min_doc_bytes, "version": ckpt.PROGRESS_VERSION,
            **({"max_doc_bytes": max_doc_bytes} if max_doc_bytes != MAX_DOC_BYTES else {})}
    state = ckpt.start(out, ckpt.args_hash(args), force=force)
    if state.done:
        return read_manifest(out)
    docs = functools.partial(documents, files, text_field=text_field,
                             max_doc_bytes=max_doc_bytes)
    tok = tokenizer if tokenizer is not None else _trained(docs, out, train_vocab)
    if tok.kind != "bytes":
        tok.save(out / TOKENIZER_FILE)
    if state.dedup is None:
        state.dedup = DocFilter(filter_cfg, min_doc_bytes=min_doc_bytes).dedup
    if state.position == 0:
        state.save(out)  # the arguments are on record before the first shard
    run = _Run(out, tok, filter_cfg, min_doc_bytes, val_fraction, shard_tokens, state,
               on_checkpoint)
    run.sources = f"data.glob {glob!r} took {len(files):,} files" if any(
        p.is_dir() for p in sources) else f"{len(files):,} files"
    run.total = len(files) if all(kind_of(f) == "text" for f in files) else None
    with ExitStack() as stack:
        pool = (stack.enter_context(ProcessPoolExecutor(workers)) if workers > 1 else None)
        bar = stack.enter_context(_bar()) if progress else None
        run.loop(itertools.islice(docs(), state.position, None), pool, bar)
    return run.finish(names)


# The chance of an empty val split, (1 - val_fraction) ** documents, above which a
# preparation is refused before it reads anything: it would most likely fail at its end.
EMPTY_SPLIT_CHANCE = 0.5


def check_splits(documents: int, val_fraction: float) -> None:
    """Refuse up front what cannot make a train and a val split: fewer than two documents,
    or so few that the val split (a ``val_fraction`` share, by content hash) would more
    likely than not be empty. Text files only: their document count is known from their
    sizes (JSONL and Parquet would have to be read)."""
    chance = (1 - val_fraction) ** documents
    if documents >= 2 and chance <= EMPTY_SPLIT_CHANCE:
        return
    need = math.ceil(math.log(EMPTY_SPLIT_CHANCE) / math.log(1 - val_fraction))
    raise ValueError(
        f"sources: {documents} document{'s' * (documents != 1)} (a text file is one, or one "
        f"per --max-doc-bytes of it): a val split of --val-fraction {val_fraction} would "
        f"{'be' if documents < 2 else 'most likely be'} empty ({need} or more documents "
        "make one likely); add documents, raise --val-fraction, or lower --max-doc-bytes")


def _trained(docs: Callable[[], Iterator[tuple[str, bytes]]], out: Path,
             vocab: int | None) -> Tokenizer:
    if (out / TOKENIZER_FILE).is_file():  # trained by the run this one resumes
        return BPETokenizer.from_file(out / TOKENIZER_FILE)
    assert vocab is not None
    return train_bpe(decodable(docs()), vocab)


def decodable(docs: Iterable[tuple[str, bytes]]) -> Iterator[str]:
    """The documents that decode as UTF-8, as text (what a tokenizer is trained on)."""
    for _, raw in docs:
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            continue


def texts(files: Sequence[Path], text_field: str = "text") -> Iterator[str]:
    """The decodable documents of ``files`` as text."""
    return decodable(documents(files, text_field=text_field))


def _bar() -> Bar:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("documents, {task.fields[tokens]:,} tokens"),
                    TimeElapsedColumn(), console=Console(stderr=True))


class _Run:
    """One session of a preparation: the loop over batches, the shards, the checkpoints."""

    def __init__(self, out: Path, tok: Tokenizer, cfg: FilterConfig, min_doc_bytes: int,
                 val_fraction: float, shard_tokens: int, state: ckpt.Progress,
                 on_checkpoint: Callable[[ckpt.Progress], None] | None) -> None:
        self.out, self.tok, self.state = out, tok, state
        self.filter = DocFilter(cfg, min_doc_bytes=min_doc_bytes)
        assert state.dedup is not None
        self.filter.dedup = state.dedup
        self.val_fraction, self.shard_tokens = val_fraction, shard_tokens
        self.dtype = dtype_for(tok.vocab_size)
        self.on_checkpoint = on_checkpoint
        self.analyse = functools.partial(analyse, shingle_words=cfg.shingle_words,
                                         num_perm=self.filter.num_perm)
        self.pending: dict[str, list[np.ndarray]] = {
            s: [p] if (p := state.pending[s]) is not None else [] for s in SPLITS}
        self.started = time.perf_counter()
        self.total: int | None = None  # documents in all, when known (for the bar)
        self.sources = ""  # what the sources gave, in words (the errors name the glob)

    def loop(self, docs: Iterable[tuple[str, bytes]], pool: ProcessPoolExecutor | None,
             bar: Bar | None) -> None:
        st = self.state
        task = (bar.add_task("prepare", total=self.total, tokens=0) if bar is not None
                else None)
        if bar is not None and task is not None:
            bar.update(task, completed=st.position)
        for batch in batches(docs):
            raws = [raw for _, raw in batch]
            found: Iterable[Analysis] = (pool.map(self.analyse, raws, chunksize=8)
                                         if pool is not None else map(self.analyse, raws))
            kept: list[tuple[str, bytes]] = []
            for raw, a in zip(raws, found, strict=True):
                st.read[0] += 1
                st.read[1] += a.size
                reason = self.filter.decide(a)
                if reason is not None:
                    st.removed[reason][0] += 1
                    st.removed[reason][1] += a.size
                else:
                    kept.append(("val" if is_val(a.digest, self.val_fraction) else "train",
                                 raw))
            t0 = time.perf_counter()
            ids = self.tok.encode_arrays([raw for _, raw in kept])
            st.tokenize_seconds += time.perf_counter() - t0
            eos = None if self.tok.eos_id is None else np.array([self.tok.eos_id])
            for (split, raw), arr in zip(kept, ids, strict=True):
                self.pending[split].append(arr)
                if eos is not None:
                    self.pending[split].append(eos)
                counts = st.kept[split]
                counts[0] += 1
                counts[1] += arr.size + (eos is not None)
                counts[2] += len(raw)
            st.position += len(batch)
            if self._flush(final=False):
                self._checkpoint()
            if bar is not None and task is not None:
                bar.update(task, completed=st.position,
                           tokens=st.kept["train"][1] + st.kept["val"][1])

    def _flush(self, *, final: bool) -> bool:
        """Write each split's full shards (and, when ``final``, the rest); whether any."""
        wrote = False
        for split in SPLITS:
            parts = self.pending[split]
            size = sum(p.size for p in parts)
            if size < self.shard_tokens and not (final and size):
                continue
            tokens = np.concatenate(parts)
            at = 0
            while tokens.size - at >= self.shard_tokens or (final and at < tokens.size):
                chunk = tokens[at : at + self.shard_tokens]
                entries = self.state.entries[split]
                entries.append(write_shard(self.out, split, len(entries), chunk, self.dtype))
                at += chunk.size
                wrote = True
            self.pending[split] = [tokens[at:]] if at < tokens.size else []
        return wrote

    def _checkpoint(self) -> None:
        st = self.state
        st.pending = {s: np.concatenate(p).astype(self.dtype) if p else None
                      for s, p in self.pending.items()}
        now = time.perf_counter()
        st.seconds += now - self.started
        self.started = now
        st.save(self.out)
        if self.on_checkpoint is not None:
            self.on_checkpoint(st)

    def remove_written(self) -> int:
        """Remove what this preparation wrote in its folder (a failed one leaves nothing
        to resume: the same arguments would fail the same way); how many files."""
        written = ckpt.ours(self.out)
        for path in written:
            path.unlink()
        return len(written)

    def finish(self, sources: list[str]) -> Manifest:
        st = self.state
        self._flush(final=True)
        for split in SPLITS:
            if not st.entries[split]:
                removed = self.remove_written()
                raise ValueError(empty_split(split, st) + f" ({self.sources}); removed the "
                                 f"{removed} file{'s' * (removed != 1)} it wrote in {self.out}")
        st.dedup = None  # done: the finished checkpoint only refuses other arguments
        st.done = True
        self._checkpoint()
        file = TOKENIZER_FILE if self.tok.kind != "bytes" else None
        manifest = Manifest(self.tok.info(file), self.dtype, st.entries,
                            documents={s: st.kept[s][0] for s in SPLITS},
                            report=report(st), sources=sources)
        write_manifest(self.out, manifest)
        return manifest


def empty_split(split: str, st: ckpt.Progress) -> str:
    """Why ``split`` ended empty, naming the filters that took the documents: a binary
    file reads "dropped by the binary filter", not only "the train split is empty"."""
    kept = st.kept["train"][0] + st.kept["val"][0]
    dropped = [f"{n} by the {reason} filter" for reason in REASONS
               if (n := st.removed[reason][0])]
    why = (f"; {', '.join(dropped)} (data.filter)" if dropped else "")
    if kept == 0:
        return (f"the {split} split is empty: all {st.read[0]} documents read were dropped"
                f"{why.replace('; ', ': ', 1)}")
    return (f"the {split} split is empty ({kept} documents kept of {st.read[0]} read{why}): "
            "add documents or raise --val-fraction")


# How the report counts the tokens a filter removed (the manifest says it beside them).
REMOVED_TOKENS = ("estimated: the removed bytes x the kept documents' tokens per byte "
                  "(exact for the bytes tokenizer)")


def estimated_tokens(removed_bytes: int, kept_tokens: int, kept_bytes: int) -> int:
    """The tokens ``removed_bytes`` of removed documents would have been, at the kept
    documents' rate. Tokenizing what is thrown away to count it cost more than the kept data
    (115.5M tokens of removed binaries against 17.3M kept, in one folder of system docs); a
    rate is what the report needs. None kept: a byte a token."""
    if kept_bytes <= 0:
        return removed_bytes
    return (removed_bytes * kept_tokens + kept_bytes // 2) // kept_bytes


def report(st: ckpt.Progress) -> dict[str, Any]:
    """The filter report the manifest carries (``timings`` differ from run to run)."""
    tokens = sum(st.kept[s][1] for s in SPLITS)
    kept_bytes = sum(st.kept[s][2] for s in SPLITS)
    shards = sum(len(e) for e in st.entries.values())
    return {
        "read": {"documents": st.read[0], "bytes": st.read[1]},
        "removed": {r: {"documents": st.removed[r][0], "bytes": st.removed[r][1],
                        "tokens": estimated_tokens(st.removed[r][1], tokens, kept_bytes)}
                    for r in REASONS},
        "removed_tokens": REMOVED_TOKENS,
        "kept": {s: {"documents": st.kept[s][0], "tokens": st.kept[s][1],
                     "bytes": st.kept[s][2]} for s in SPLITS},
        "timings": {"seconds": round(st.seconds, 3),
                    "tokenize_seconds": round(st.tokenize_seconds, 3),
                    "tokens_per_s": round(tokens / max(st.tokenize_seconds, 1e-9)),
                    "shards_per_minute": round(shards / max(st.seconds / 60, 1e-9), 2)},
    }
