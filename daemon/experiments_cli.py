"""``traind experiments``: submit, list, show and cancel A/B experiments on a running daemon.

A client of the JSON API (/api/experiments, see traind.web.routes.experiments) over httpx.
Changing state (submit, cancel) needs the daemon's token, from ``--token`` or the file the
daemon wrote at first start (``--token-file``, default var/token). There is deliberately no
environment variable for it: ``TRAIND_*`` names are the config's, and an unknown one is an
error there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.table import Table

from traind.daemon.config import parse_value

experiments_app = typer.Typer(help="A/B experiments on a running daemon (through its API).",
                              no_args_is_help=True)

DEFAULT_URL = "http://127.0.0.1:8800"

UrlOpt = Annotated[str, typer.Option("--url", help="The daemon's base URL.")]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", show_default=False, help="The daemon's token (default: read --token-file).")]
TokenFileOpt = Annotated[Path, typer.Option(
    "--token-file", dir_okay=False, help="File holding the daemon's token.")]


class ApiError(RuntimeError):
    """A request the daemon refused or never answered; the message says what to do."""


def _out() -> Console:
    # Built per call, not at import: the width then follows COLUMNS as it is now.
    return Console(highlight=False)


def _fail(message: str, code: int = 1) -> NoReturn:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def parse_arm(text: str) -> dict[str, Any]:
    """``NAME`` or ``NAME:key=value,key=value`` with keys ``precision`` and ``compression.*``:
    ``int8:compression.method=int8``, ``bf16:precision=bf16``."""
    name, _, settings = text.partition(":")
    if not name.strip():
        raise typer.BadParameter(f"{text!r}: an arm needs a name (NAME[:key=value,...])")
    arm: dict[str, Any] = {"name": name.strip(), "compression": {}, "precision": None}
    for item in filter(None, (s.strip() for s in settings.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise typer.BadParameter(f"{text!r}: {item!r} is not key=value")
        if key == "precision":
            arm["precision"] = raw.strip() or None
        elif key.startswith("compression.") and len(key) > len("compression."):
            arm["compression"][key.removeprefix("compression.")] = parse_value(raw.strip())
        else:
            raise typer.BadParameter(
                f"{text!r}: unknown key {key!r} (use precision=... or compression.<field>=...)")
    return arm


def parse_sets(sets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set {item!r}: expected key.path=value")
        out[key.strip()] = parse_value(raw)
    return out


def read_token(token: str | None, token_file: Path) -> str:
    if token:
        return token
    try:
        text = token_file.read_text().strip()
    except FileNotFoundError:
        _fail(f"no token: {token_file} does not exist; pass --token or --token-file "
              "(the daemon writes it at first start)")
    except OSError as exc:
        _fail(f"cannot read the token file {token_file}: {exc.strerror or exc}")
    if not text:
        _fail(f"the token file {token_file} is empty; pass --token or --token-file")
    return text


def request(method: str, url: str, path: str, *, token: str | None = None,
            json_body: Any = None, timeout: float = 30.0) -> Any:
    """One API call; the decoded JSON answer, or :class:`ApiError` with a message for people."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, base + path, headers=headers, json=json_body, timeout=timeout)
    except httpx.ConnectError:
        raise ApiError(f"no daemon at {base} (is `traind serve` running? see --url)") from None
    except httpx.TransportError as exc:
        raise ApiError(f"no answer from the daemon at {base}: {exc}") from None
    if r.is_success:
        return r.json()
    raise ApiError(_error_message(r))


def _error_message(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if r.status_code == 401:
        return "token rejected: pass --token or --token-file"
    if r.status_code == 422 and isinstance(detail, list):
        lines = []
        for item in detail:
            loc = [str(p) for p in item.get("loc", []) if p != "body"]
            lines.append(f"  {'.'.join(loc) or '(request)'}: {item.get('msg', '')}")
        return "invalid experiment:\n" + "\n".join(lines)
    if isinstance(detail, str):
        return detail
    return f"HTTP {r.status_code} from {r.request.url}: {r.text[:500]}"


def _call(method: str, url: str, path: str, **kw: Any) -> Any:
    try:
        return request(method, url, path, **kw)
    except ApiError as exc:
        _fail(str(exc))


def _num(value: Any, spec: str) -> str:
    return "\u2013" if value is None else format(value, spec)


def _when(value: str | None) -> str:
    # ISO 8601 from the API; to the minute, as the web pages show it.
    return "\u2013" if not value else value.replace("T", " ")[:16]


def experiments_table(items: list[dict[str, Any]]) -> Table:
    table = Table(title="Experiments (newest first, times in UTC)", title_justify="left")
    table.add_column("ID", justify="right")
    for col in ("Name", "State", "Arms", "Verdict"):
        table.add_column(col)
    table.add_column("Run", justify="right")
    table.add_column("Created")
    for e in items:
        verdict = e.get("verdict") or {}
        table.add_row(
            str(e["id"]), e["name"], e["state"], " vs ".join(e["arms"]),
            ", ".join(f"{arm}: {v.get('kind', '')}" for arm, v in verdict.items()) or "\u2013",
            "\u2013" if e.get("run_id") is None else str(e["run_id"]), _when(e["created_at"]))
    return table


def verdict_table(e: dict[str, Any]) -> Table:
    baseline = e["arms"][0] if e["arms"] else ""
    table = Table(title=f"Verdict against {baseline}", title_justify="left")
    table.add_column("Arm")
    table.add_column("Verdict")
    for col in ("Speed-up", "Low", "High", "p"):
        table.add_column(col, justify="right")
    table.add_column("Reason", overflow="fold")
    verdict = e.get("verdict") or {}
    for arm in e["arms"][1:]:
        v = verdict.get(arm) or {}
        table.add_row(arm, str(v.get("kind", "pending")), _num(v.get("ratio"), ".3f"),
                      _num(v.get("low"), ".3f"), _num(v.get("high"), ".3f"),
                      _num(v.get("p_value"), ".2g"), str(v.get("reason", "")))
    return table


@experiments_app.command()
def submit(
    name: Annotated[str, typer.Option("--name", help="The experiment's name.")],
    arms: Annotated[list[str], typer.Option(
        "--arm", help="NAME[:key=value,...], keys precision and compression.*; the first is "
                      "the baseline: --arm none --arm 'int8:compression.method=int8'.")],
    steps: Annotated[int, typer.Option("--steps", help="The budget, in optimizer steps.")],
    block_steps: Annotated[int, typer.Option("--block-steps",
                                             help="Steps per block of one arm.")] = 20,
    warmup_steps: Annotated[int | None, typer.Option(
        "--warmup-steps", help="Steps of each block not measured (daemon default 3).")] = None,
    loss_margin: Annotated[float | None, typer.Option(
        "--loss-margin", help="How much worse an arm's loss may be (daemon default 0.05).")]
    = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Base-config field: --set model.n_layers=2 (repeatable).")] = None,
    mode: Annotated[str, typer.Option(
        "--mode", help="interleaved (arms alternate in one job) or forked (each arm runs "
                       "--repeats short jobs from one checkpoint).")] = "interleaved",
    repeats: Annotated[int, typer.Option("--repeats", help="forked: trials per arm.")] = 2,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = Path("var/token"),
) -> None:
    """Submit an A/B experiment; prints its id and where to follow it."""
    parsed = [parse_arm(a) for a in arms]
    if len(parsed) < 2:
        raise typer.BadParameter("give at least two --arm (the first is the baseline)",
                                 param_hint="--arm")
    body: dict[str, Any] = {"name": name, "steps": steps, "block_steps": block_steps,
                            "overrides": parse_sets(sets or []), "arms": parsed,
                            "mode": mode, "repeats": repeats}
    if warmup_steps is not None:
        body["warmup_steps"] = warmup_steps
    if loss_margin is not None:
        body["loss_margin"] = loss_margin
    e = _call("POST", url, "/api/experiments", token=read_token(token, token_file),
              json_body=body)
    _out().print(f"experiment {e['id']} {e['name']} {e['state']}: {' vs '.join(e['arms'])}"
                 + ("" if e.get("run_id") is None else f" (run {e['run_id']})"))
    _out().print(f"follow it at {url.rstrip('/')}/experiments/{e['id']}", soft_wrap=True)


@experiments_app.command("list")
def list_(url: UrlOpt = DEFAULT_URL) -> None:
    """Every experiment, newest first."""
    items = _call("GET", url, "/api/experiments")
    if not items:
        _out().print("no experiments yet")
        return
    _out().print(experiments_table(items))


@experiments_app.command()
def show(
    experiment_id: Annotated[int, typer.Argument(metavar="ID", help="The experiment's id.")],
    url: UrlOpt = DEFAULT_URL,
) -> None:
    """One experiment: state, arms, run, and the verdict per arm with its interval."""
    e = _call("GET", url, f"/api/experiments/{experiment_id}")
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for key, value in (
        ("Experiment", f"{e['id']} {e['name']}"), ("State", e["state"]), ("Mode", e["mode"]),
        ("Arms", " vs ".join(e["arms"])),
        ("Run", "\u2013" if e.get("run_id") is None else str(e["run_id"])),
        ("Created", _when(e["created_at"])), ("Finished", _when(e.get("finished_at"))),
        ("Config", e["config_hash"]),
    ):
        head.add_row(key, value)
    out = _out()
    out.print(head)
    out.print(verdict_table(e))


@experiments_app.command()
def cancel(
    experiment_id: Annotated[int, typer.Argument(metavar="ID", help="The experiment's id.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = Path("var/token"),
) -> None:
    """Stop an experiment's job and mark it cancelled."""
    e = _call("POST", url, f"/api/experiments/{experiment_id}/cancel",
              token=read_token(token, token_file))
    _out().print(f"experiment {e['id']} {e['name']}: {e['state']}")
