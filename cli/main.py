"""The ``traind`` command line: it parses, loads the config and hands over; nothing else."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler

from traind import __version__
from traind.cli.console import print_error
from traind.cli.data import data_app
from traind.cli.experiments import experiments_app
from traind.cli.grafana import grafana_app
from traind.cli.profile import profile
from traind.cli.service import service_app
from traind.daemon.config import ConfigError, Settings, load_settings
from traind.extras import MissingExtra

app = typer.Typer(help="traind: an observability-first training daemon.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(db_app, name="db")
metrics_app = typer.Typer(help="The metric catalog.", no_args_is_help=True)
app.add_typer(metrics_app, name="metrics")
app.add_typer(grafana_app, name="grafana")
app.add_typer(experiments_app, name="experiments")
app.add_typer(service_app, name="service")
app.add_typer(data_app, name="data")
app.command("profile")(profile)
console = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="TOML config file (then TRAIND_* variables, then --set).",
    exists=False, dir_okay=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override one field: --set job.steps=500 (repeatable).")]


def _settings(config: Path | None, sets: list[str] | None, extra: list[str] | None = None
              ) -> Settings:
    try:
        return load_settings(config, overrides=[*(extra or []), *(sets or [])])
    except ConfigError as exc:
        print_error(exc)
        raise typer.Exit(2) from None


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8800).")] = None,
    var_dir: Annotated[Path | None, typer.Option(help="State folder (default ./var).")] = None,
    no_default_job: Annotated[bool, typer.Option(
        "--no-default-job", help="Do not start the configured job at start-up.")] = False,
    sets: SetOpt = None,
) -> None:
    """Run the daemon: web UI, /metrics, and the configured training job."""
    extra = [f"daemon.{k}={v}" for k, v in
             (("host", host), ("port", port), ("var_dir", var_dir)) if v is not None]
    if no_default_job:
        extra.append("daemon.default_job=false")
    settings = _settings(config, sets, extra)
    _logging()
    from traind.daemon.admission import shipped_job
    from traind.daemon.node import Node

    try:  # no config file: the shipped job, two ranks where the node has them
        settings = shipped_job(settings, config)
    except ConfigError as exc:
        print_error(exc)
        raise typer.Exit(2) from None

    d = settings.daemon
    console.print(f"traind {__version__} serving on [bold]http://{d.host}:{d.port}[/] "
                  f"(state in {d.var_dir.resolve()})", highlight=False)
    try:
        node = Node(settings)
    except ConfigError as exc:
        print_error(exc)
        raise typer.Exit(2) from None
    var = d.var_dir.resolve()
    made = "made now, " if node.token_created else ""
    console.print(f"log in: open the one-time link in {var / 'login-url'}, or give the token in "
                  f"{var / 'token'} ({made}mode 0600) at /login; the API takes it as "
                  "'Authorization: Bearer <token>'", highlight=False, soft_wrap=True)
    asyncio.run(node.serve())


@app.command()
def run(
    config: Annotated[Path | None, typer.Argument(help="TOML config file.")] = None,
    sets: SetOpt = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Also print the outcome as JSON on stdout: state, exit code, error, "
        "the run's folder, log and history.csv, and its summary.")] = False,
) -> None:
    """Train one job in the foreground with a progress bar (the daemon's own trainer); the
    lead rank's steps go to history.csv in the run's folder."""
    settings = _settings(config, sets)
    from traind.cli.foreground import run_foreground

    report: dict[str, Any] = {}
    try:
        code = asyncio.run(run_foreground(settings, console, report))
    except ConfigError as exc:  # what the config names but the node cannot give: one line
        print_error(exc)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(report, default=str))
    raise typer.Exit(code)


@db_app.command("upgrade")
def db_upgrade(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Apply the database migrations up to the newest."""
    settings = _settings(config, sets)
    from traind.daemon.db.engine import default_url, redact
    from traind.daemon.db.migrate import upgrade

    var = settings.daemon.var_dir
    var.mkdir(parents=True, exist_ok=True)
    url = settings.daemon.db_url or default_url(var)
    upgrade(url)
    console.print(f"database at head: {redact(url)}", highlight=False)


cluster_app = typer.Typer(help="Multi-node jobs on the cluster's shared queue.",
                          no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("submit")
def cluster_submit(config: ConfigOpt = None, sets: SetOpt = None) -> None:
    """Queue the configured job (job.nnodes >= 2, job.rdzv_endpoint) as one slot per node;
    the daemons with daemon.cluster on claim the slots and launch it together."""
    settings = _settings(config, sets)
    import torch

    from traind.daemon.config import train_config
    from traind.daemon.db.engine import default_url, make_engine, redact
    from traind.daemon.db.migrate import upgrade
    from traind.daemon.experiments.cluster import create_cluster_job

    settings.daemon.var_dir.mkdir(parents=True, exist_ok=True)
    url = settings.daemon.db_url or default_url(settings.daemon.var_dir)
    upgrade(url)
    cfg = train_config(settings, default_out_dir=Path())
    try:
        job_id = create_cluster_job(make_engine(url), cfg, traind_version=__version__,
                                    torch_version=torch.__version__, device="any")
    except ValueError as exc:
        print_error(exc)
        raise typer.Exit(2) from None
    console.print(f"cluster job {job_id}: {cfg.job.nnodes} node slots queued at "
                  f"{redact(url)}", highlight=False)


@metrics_app.command("docs")
def metrics_docs(
    out: Annotated[Path, typer.Option(help="Where to write the page.")] = Path("docs/metrics.md"),
) -> None:
    """Write docs/metrics.md from the catalog."""
    from traind.metrics.catalog import markdown

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown())
    console.print(f"wrote {out}", highlight=False)


@app.command()
def version() -> None:
    """Print the versions of traind, torch and Python."""
    import torch

    typer.echo(f"traind {__version__} (torch {torch.__version__}, "
               f"python {sys.version.split()[0]})")


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, show_path=False)])
    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per plugin otherwise


def main() -> None:
    try:
        app()
    except MissingExtra as exc:  # an optional part a command needs: one line, not a traceback
        print_error(exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
