"""``traind profile RUN --steps N``: profile a running run and print where its time goes.

A client of the JSON API (``POST /api/runs/{id}/profile``, then ``GET
/api/runs/{id}/profiles/{capture}`` until the report is built: traind.web.routes.runs). It
waits with a spinner that says what it waits for, prints each rank's split, the straggler
line and the top operators, and with ``--out`` downloads the traces for Perfetto.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from traind.cli.console import fail
from traind.cli.experiments import (
    DEFAULT_URL,
    ApiError,
    TokenFileOpt,
    TokenOpt,
    UrlOpt,
    read_token,
    request,
)
from traind.contracts.control import PROFILE_STEPS_MAX
from traind.daemon.service import rank_list

WAITING = {"waiting": "waiting for the run's next report step and its ranks' traces",
           "analysing": "analysing the traces"}
POLL_SECONDS = 0.5


def _ms(value: Any) -> str:
    if not isinstance(value, int | float):
        return "\u2013"
    return f"{value:,.1f} ms" if value >= 1 else f"{value * 1e3:,.0f} \u00b5s"


def _pct(value: Any) -> str:
    return "\u2013" if not isinstance(value, int | float) else f"{100 * value:.1f}%"


def breakdown_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"Where the traced steps' time went ({report.get('timeline')} "
                        "timeline)", title_justify="left")
    for name in ("rank", "traced", "compute", "exposed comm", "idle", "comm", "overlap",
                 "peak MiB"):
        table.add_column(name, justify="left" if name == "rank" else "right")
    for r in report.get("ranks", []):
        peak = max((m.get("peak_mib") or 0 for m in (r.get("memory") or {}).values()),
                   default=None)
        table.add_row(str(r["rank"]), _ms(r["window_ms"]), _ms(r["compute_ms"]),
                      _ms(r["exposed_comm_ms"]), _ms(r["idle_ms"]), _ms(r["comm_ms"]),
                      _pct(r.get("overlap")), "\u2013" if peak is None else f"{peak:,.1f}")
    return table


def ops_table(rank: dict[str, Any], limit: int = 8) -> Table:
    table = Table(title=f"Top operators of rank {rank['rank']} by self time",
                  title_justify="left")
    for name in ("operator", "calls", "self", "share"):
        table.add_column(name, justify="left" if name == "operator" else "right")
    for op in rank.get("top_ops", [])[:limit]:
        table.add_row(op["name"], str(op["calls"]), _ms(op["self_ms"]), _pct(op["share"]))
    return table


def straggler_line(report: dict[str, Any]) -> str | None:
    rows = report.get("straggler") or []
    if not rows:
        return None
    last = report["last_rank"]
    return (f"rank {last} reached the first collective last in "
            f"{report['last_counts'][str(last)]} of {len(rows)} "
            f"steps; median skew {_ms(report.get('median_skew_ms'))}")


def profile(
    run_id: Annotated[int, typer.Argument(
        min=1, metavar="RUN", help="The run to profile (running on this daemon's node).")],
    steps: Annotated[int, typer.Option(min=1, max=PROFILE_STEPS_MAX,
                                       help="Steps to trace.")] = 5,
    ranks: Annotated[str | None, typer.Option(
        help="Ranks to trace, comma-separated (default: every rank).")] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the report and print it.")] = True,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for the report.")
                       ] = 600.0,
    out: Annotated[Path | None, typer.Option(
        file_okay=False, help="Download the traces into this folder (Perfetto opens them).")
                   ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = Path("var/token"),
) -> None:
    """Profile a running run: torch.profiler on each chosen rank for STEPS steps from its next
    report step, then the report (compute / communication / idle per rank, overlap, top
    operators, memory, arrival skew) and where to open it."""
    console = Console(highlight=False)
    try:
        body = {"steps": steps, "ranks": rank_list(ranks)}
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ranks") from None
    try:
        capture = request("POST", url, f"/api/runs/{run_id}/profile",
                          token=read_token(token, token_file), json_body=body, what="profile")
    except ApiError as exc:
        raise fail(str(exc)) from None
    number = capture["capture"]
    page = f"{url.rstrip('/')}{capture['report_url']}"
    console.print(f"run {run_id}: profile {number} asked ({steps} steps, ranks "
                  f"{', '.join(map(str, capture['ranks']))}); report: {page}")
    if not wait:
        return
    deadline = time.monotonic() + timeout
    path = f"/api/runs/{run_id}/profiles/{number}"
    with console.status(WAITING["waiting"]) as status:
        while True:
            try:
                got = request("GET", url, path, what="profile")
            except ApiError as exc:
                raise fail(str(exc)) from None
            state = got["capture"]["state"]
            if state not in WAITING:
                break
            if time.monotonic() > deadline:
                raise fail(f"profile {number} still {state} after {timeout:.0f} s; the report "
                           f"will be at {page}")
            status.update(WAITING[state])
            time.sleep(POLL_SECONDS)
    if state != "ready":
        raise fail(f"profile {number} {state}: {got['capture'].get('error') or 'no report'}")
    report = got["report"]
    console.print(breakdown_table(report))
    if (line := straggler_line(report)) is not None:
        console.print(line)
    if report.get("ranks"):
        console.print(ops_table(report["ranks"][0]))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for rank, link in sorted(got["capture"]["trace_urls"].items()):
            target = out / f"run{run_id}-profile{number}-rank{rank}.json.gz"
            try:
                r = httpx.get(url.rstrip("/") + link, timeout=60)
                r.raise_for_status()
            except httpx.HTTPError as exc:
                raise fail(f"trace of rank {rank} not downloaded: {exc}") from None
            target.write_bytes(r.content)
            console.print(f"trace of rank {rank}: {target}")
    console.print(f"report: {page}")
