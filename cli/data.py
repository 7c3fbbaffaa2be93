"""``traind data``: prepare token shards once (``prepare``) and train a tokenizer
(``tokenizer train``); data/prepare.py does the work, this parses, loads the config and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from traind.cli.console import fail
from traind.daemon.config import ConfigError, load_settings
from traind.data.sources import MAX_DOC_BYTES
from traind.extras import MissingExtra

if TYPE_CHECKING:
    from traind.data.manifest import Manifest
    from traind.trainer.config import DataConfig

data_app = typer.Typer(help="Prepare training data: token shards and tokenizers.",
                       no_args_is_help=True)
tokenizer_app = typer.Typer(help="Byte-level BPE tokenizers.", no_args_is_help=True)
data_app.add_typer(tokenizer_app, name="tokenizer")
console = Console(stderr=True)

SourcesArg = Annotated[list[Path] | None, typer.Argument(
    help="Text files, folders (searched with data.glob), .jsonl or .parquet files; none: "
         "data.paths, or the Python standard library's source.", show_default=False)]
TextFieldOpt = Annotated[str, typer.Option(
    "--text-field", help="The text field of JSONL records / column of Parquet files.")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="TOML config file (data.* is read from it).", dir_okay=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override one field: --set data.filter.min_entropy=2.5 (repeatable).")]


def _data_config(config: Path | None, overrides: list[str]) -> DataConfig:
    try:
        return load_settings(config, overrides=overrides).data
    except ConfigError as exc:
        raise fail(exc, 2) from None


@data_app.command()
def prepare(
    sources: SourcesArg = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the shards.",
                                      file_okay=False)] = Path("shards"),
    tokenizer: Annotated[str | None, typer.Option(
        help="bytes or bpe (default: data.tokenizer).")] = None,
    tokenizer_file: Annotated[Path | None, typer.Option(
        help="A tokenizer.json for bpe (default: data.tokenizer_file).")] = None,
    vocab: Annotated[int | None, typer.Option(
        min=257, help="bpe without a file: train one of this many ids on the sources.")] = None,
    val_fraction: Annotated[float | None, typer.Option(
        help="Held-out share of documents (default: data.val_fraction).")] = None,
    shard_tokens: Annotated[int, typer.Option(min=1, help="Tokens per shard.")] = 2**24,
    workers: Annotated[int, typer.Option(min=1, help="Processes analysing documents.")] = 1,
    max_doc_bytes: Annotated[int, typer.Option(
        min=1024, help="The largest document held at once: a longer file or record is "
        "read in pieces of this size, cut at a line (memory follows it, ~15x).")
    ] = MAX_DOC_BYTES,
    text_field: TextFieldOpt = "text",
    force: Annotated[bool, typer.Option(
        "--force", help="Prepare again in a folder holding other shards.")] = False,
    config: ConfigOpt = None,
    sets: SetOpt = None,
) -> None:
    """Filter, split and tokenize documents into token shards (resumes an interrupted run)."""
    from traind.data.prepare import prepare as run_prepare
    from traind.data.tokenizer import load_tokenizer

    extra = [f"data.{k}={v}" for k, v in (("tokenizer", tokenizer),
                                         ("tokenizer_file", tokenizer_file),
                                         ("val_fraction", val_fraction)) if v is not None]
    cfg = _data_config(config, [*extra, *(sets or [])])
    from traind.data.sources import census

    for said in census(sources or list(cfg.paths), cfg.glob):  # what each folder gives
        console.print(said, style="yellow" if said.startswith("warning") else None,
                      highlight=False, markup=False)
    try:
        tok = (None if cfg.tokenizer == "bpe" and cfg.tokenizer_file is None and vocab
               else load_tokenizer(cfg.tokenizer, cfg.tokenizer_file))
        manifest = run_prepare(
            sources or list(cfg.paths), out, filter_cfg=cfg.filter, tokenizer=tok,
            train_vocab=vocab, val_fraction=cfg.val_fraction, shard_tokens=shard_tokens,
            min_doc_bytes=cfg.min_doc_bytes, glob=cfg.glob, text_field=text_field,
            workers=workers, force=force, progress=True, max_doc_bytes=max_doc_bytes)
    except MissingExtra as exc:
        raise fail(exc) from None
    except ValueError as exc:
        raise fail(exc, 2) from None
    Console().print(summary(manifest))
    t = manifest.report.get("timings", {})
    Console().print(f"{t.get('tokens_per_s', 0):,} tokens/s tokenized, "
                    f"{t.get('shards_per_minute', 0):,} shards/minute; shards in {out}",
                    highlight=False)


def summary(manifest: Manifest) -> Table:
    """The filter report as a table: documents, bytes and tokens removed per reason, kept per
    split."""
    report = manifest.report
    table = Table(title=f"{manifest.tokenizer.kind} tokenizer, vocab "
                        f"{manifest.tokenizer.vocab_size:,}", title_justify="left")
    for name in ("", "documents", "bytes", "tokens"):
        table.add_column(name, justify="left" if not name else "right")
    read = report.get("read", {})
    table.add_row("read", f"{read.get('documents', 0):,}", f"{read.get('bytes', 0):,}", "")
    for reason, n in report.get("removed", {}).items():
        if n["documents"]:
            table.add_row(f"removed: {reason}", f"{n['documents']:,}", f"{n['bytes']:,}",
                          f"{n['tokens']:,}")
    for split, n in report.get("kept", {}).items():
        table.add_row(f"kept: {split}", f"{n['documents']:,}", f"{n['bytes']:,}",
                      f"{n['tokens']:,}")
    if how := report.get("removed_tokens"):
        table.caption = escape(f"removed tokens: {how}")
        table.caption_justify = "left"
    return table


@tokenizer_app.command("train")
def tokenizer_train(
    sources: SourcesArg = None,
    vocab: Annotated[int, typer.Option(min=257, help="Vocabulary size.")] = 8192,
    out: Annotated[Path, typer.Option("--out", "-o", help="The tokenizer.json to write.",
                                      dir_okay=False)] = Path("tokenizer.json"),
    min_frequency: Annotated[int, typer.Option(min=1, help="Least count of a merge.")] = 2,
    text_field: TextFieldOpt = "text",
    config: ConfigOpt = None,
    sets: SetOpt = None,
) -> None:
    """Train a byte-level BPE on the sources (locally; nothing is downloaded)."""
    from traind.data.prepare import texts
    from traind.data.sources import input_files
    from traind.data.tokenizer import train_bpe

    cfg = _data_config(config, list(sets or []))
    try:
        files = input_files(sources or list(cfg.paths), cfg.glob)
        tok = train_bpe(texts(files, text_field), vocab, min_frequency=min_frequency)
        tok.save(out)
    except MissingExtra as exc:
        raise fail(exc) from None
    except ValueError as exc:
        raise fail(exc, 2) from None
    Console().print(f"{out}: byte-level BPE of {tok.vocab_size:,} ids trained on "
                    f"{len(files):,} files (hash {tok.hash})", highlight=False)
