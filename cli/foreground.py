"""``traind run``: one job in the foreground, through the same launcher and events as the
daemon, drawn as a rich progress bar instead of web charts."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from traind.contracts.events import Event, LifecycleEvent
from traind.daemon.admission import check, resources
from traind.daemon.config import Settings, corpus_cache_dir, train_config
from traind.daemon.runs.jobs import Job
from traind.daemon.runs.summary import RunSummary

if TYPE_CHECKING:
    from rich.console import Console


async def run_foreground(settings: Settings, console: Console) -> int:
    """Train ``settings``' job in the foreground; its exit code. A job the node would refuse
    (daemon/admission.py: ranks, memory, a factory that does not build, data that is not
    there) raises ``ConfigError`` before anything launches, as ``traind serve`` refuses it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cfg = train_config(settings, default_out_dir=settings.daemon.var_dir / "runs"
                       / f"{settings.job.name}-{stamp}",
                       default_cache_dir=corpus_cache_dir(settings.daemon.var_dir))
    check(cfg, resources(), oversubscribe=settings.daemon.oversubscribe)
    out_dir = cfg.job.out_dir
    assert out_dir is not None
    summary = RunSummary(total_steps=cfg.job.steps)
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}[/] val [magenta]{task.fields[val]}[/]"),
        TextColumn("{task.fields[tps]} tok/s"), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, transient=False)
    task = progress.add_task(cfg.job.name, total=cfg.job.steps, loss="-", val="-", tps="-")

    def on_event(event: Event) -> None:
        summary.observe(event)
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
    with progress:
        await job.start()
        try:
            exit_ = await job.wait()
        except BaseException:
            await job.stop()
            raise
    table = Table(title=f"{cfg.job.name}: {exit_.state}")
    for col in ("step", "loss", "val loss", "tokens/s", "tokens", "params", "checkpoints"):
        table.add_column(col, justify="right")
    table.add_row(str(summary.step), _fmt(summary.loss), _fmt(summary.val_loss),
                  f"{summary.tokens_per_second:,.0f}", f"{summary.tokens:,}",
                  f"{summary.params:,}" if summary.params else "-", str(summary.checkpoints))
    console.print(table)
    if exit_.state == "failed":
        console.print(f"[bold red]{exit_.describe()}[/]", highlight=False)
    return 0 if exit_.code == 0 else 1


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
