"""``traind run``: one job in the foreground, through the same launcher and events as the
daemon, drawn as a rich progress bar instead of web charts.

The bar and the summary show the lead rank's figures (rank 0: the daemon's own fold, with the
job's ranks per node). Every lead-rank step and evaluation is also appended to
``history.csv`` in the run's folder as it comes (the columns of the daemon's CSV export), for a
user to plot or read back. A failed job is one line: which rank, how, and its own error; the
launcher's traceback stays in the log.
"""

from __future__ import annotations

import csv
import time
from typing import IO, TYPE_CHECKING, Any

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from traind.contracts.events import EvalEvent, Event, LifecycleEvent, StepEvent
from traind.daemon.admission import check, resources
from traind.daemon.config import Settings, corpus_cache_dir, train_config
from traind.daemon.ingest.series import STEP_COLUMNS
from traind.daemon.runs.jobs import Job
from traind.daemon.runs.summary import RunSummary

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

HISTORY_NAME = "history.csv"


async def run_foreground(settings: Settings, console: Console,
                         report: dict[str, Any] | None = None) -> int:
    """Train ``settings``' job in the foreground; its exit code. A job the node would refuse
    (daemon/admission.py: ranks, memory, a factory that does not build, data that is not
    there) raises ``ConfigError`` before anything launches, as ``traind serve`` refuses it.
    ``report``: filled with the run's outcome (``traind run --json`` prints it)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cfg = train_config(settings, default_out_dir=settings.daemon.var_dir / "runs"
                       / f"{settings.job.name}-{stamp}",
                       default_cache_dir=corpus_cache_dir(settings.daemon.var_dir))
    check(cfg, resources(), oversubscribe=settings.daemon.oversubscribe)
    out_dir = cfg.job.out_dir
    assert out_dir is not None
    summary = RunSummary(total_steps=cfg.job.steps, ranks_per_node=cfg.job.nproc_per_node)
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}[/] val [magenta]{task.fields[val]}[/]"),
        TextColumn("{task.fields[tps]} tok/s"), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, transient=False)
    task = progress.add_task(cfg.job.name, total=cfg.job.steps, loss="-", val="-", tps="-")
    out_dir.mkdir(parents=True, exist_ok=True)
    history = History(out_dir / HISTORY_NAME)

    def on_event(event: Event) -> None:
        summary.observe(event)
        if not summary.lead(event.rank):
            return
        history.add(event, summary.tokens_per_second)
        if isinstance(event, LifecycleEvent) and event.phase == "resumed":
            console.print(f"resumed from step {event.step}")
        if isinstance(event, LifecycleEvent) and event.phase == "compile_fallback":
            console.print(f"[yellow]warning:[/] job.compile fell back to eager: "
                          f"{escape(str(event.detail.get('reason')))}", highlight=False)
        progress.update(
            task, completed=summary.step,
            loss=f"{summary.loss:.4f}" if summary.loss is not None else "-",
            val=f"{summary.val_loss:.4f}" if summary.val_loss is not None else "-",
            tps=f"{summary.tokens_per_second:,.0f}")

    job = Job(cfg, out_dir, on_event, log_lines=settings.daemon.log_lines)
    console.print(f"training [bold]{cfg.job.name}[/]: {cfg.job.nproc_per_node} rank(s), "
                  f"out_dir {out_dir}, log {job.log_path}", highlight=False)
    try:
        with progress:
            await job.start()
            try:
                exit_ = await job.wait()
            except BaseException:
                await job.stop()
                raise
    finally:
        history.close()
    table = Table(title=f"{cfg.job.name}: {exit_.state}")
    for col in ("step", "loss", "val loss", "tokens/s", "tokens", "params", "checkpoints"):
        table.add_column(col, justify="right")
    table.add_row(str(summary.step), _fmt(summary.loss), _fmt(summary.val_loss),
                  f"{summary.tokens_per_second:,.0f}", f"{summary.tokens:,}",
                  f"{summary.params:,}" if summary.params else "-", str(summary.checkpoints))
    console.print(table)
    console.print(f"history: {history.path}", highlight=False)
    failed = exit_.headline()
    if failed is not None:  # one line; the launcher's traceback is in the log
        console.print(f"[bold red]error:[/] {escape(failed)} (the whole log: {job.log_path})",
                      highlight=False)
    if report is not None:
        report.update({"name": cfg.job.name, "state": exit_.state, "exit_code": exit_.code,
                       "error": failed, "out_dir": str(out_dir), "log": str(job.log_path),
                       "history": str(history.path), "summary": summary.as_dict()})
    return 0 if exit_.code == 0 else 1


class History:
    """The lead rank's steps and evaluations as CSV rows, appended as they come: the
    daemon's export columns (``STEP_COLUMNS``, tokens/s the job's as the summary smooths it)
    and ``val_loss`` on an evaluation's row. A resumed run appends to its folder's file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        new = not path.exists() or path.stat().st_size == 0
        self._f: IO[str] = open(path, "a", newline="")  # noqa: SIM115 - close()
        self._w = csv.writer(self._f)
        if new:
            self._w.writerow([*STEP_COLUMNS, "val_loss"])

    def add(self, event: Event, tokens_per_second: float) -> None:
        if isinstance(event, StepEvent):
            row = {"step": event.step, "time": event.time, "loss": event.loss, "lr": event.lr,
                   "grad_norm": event.grad_norm, "tokens_per_second": tokens_per_second,
                   "step_seconds": event.step_seconds, "data_seconds": event.data_seconds}
            self._w.writerow([*(row[c] for c in STEP_COLUMNS), ""])
        elif isinstance(event, EvalEvent):
            self._w.writerow([event.step, event.time, *[""] * (len(STEP_COLUMNS) - 2),
                              event.val_loss])
        else:
            return
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
