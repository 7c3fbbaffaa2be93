"""``traind experiments``: submit, list, show and cancel A/B experiments on a running daemon;
start and follow auto-tuning searches; see and reorder the queue of waiting trials.

A client of the JSON API (/api/experiments, /api/autotunes, /api/queue: see
traind.web.routes.experiments and traind.web.routes.autotunes) over httpx.
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

from traind.cli.console import fail
from traind.daemon.autotune.search import quality_status, setting_label
from traind.daemon.config import parse_value
from traind.daemon.experiments.bands import band_label
from traind.daemon.service import (
    EXPERIMENT_STEPS,
    MAX_PAGE,
    PAGE,
    TUNE_QUALITY_REPEATS,
    TUNE_QUALITY_STEPS,
    TUNE_STEPS,
)

experiments_app = typer.Typer(help="A/B experiments on a running daemon (through its API).",
                              no_args_is_help=True)

DEFAULT_URL = "http://127.0.0.1:8800"

UrlOpt = Annotated[str, typer.Option("--url", help="The daemon's base URL.")]
LimitOpt = Annotated[int, typer.Option(min=1, max=MAX_PAGE, help="Items per page.")]
OffsetOpt = Annotated[int, typer.Option(min=0, help="Items to skip (the page's start).")]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", show_default=False, help="The daemon's token (default: read --token-file).")]
TokenFileOpt = Annotated[Path, typer.Option(
    "--token-file", dir_okay=False, help="File holding the daemon's token.")]


class ApiError(RuntimeError):
    """A request the daemon refused or never answered; the message says what to do."""


def _out() -> Console:
    # Built per call, not at import: the width then follows COLUMNS as it is now.
    # markup off: what it prints is data (reasons, names), and "traind[fp8]" is not a tag
    return Console(highlight=False, markup=False)


def _fail(message: str, code: int = 1) -> NoReturn:
    raise fail(message, code)


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
            json_body: Any = None, timeout: float = 30.0, what: str = "experiment") -> Any:
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
    raise ApiError(_error_message(r, what))


def _error_message(r: httpx.Response, what: str = "experiment") -> str:
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
        return f"invalid {what}:\n" + "\n".join(lines)
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


# The verdict's bands, one definition for experiments and searches (unset: the daemon's default).
LossMarginOpt = Annotated[float | None, typer.Option(
    "--loss-margin", help="How far an arm's loss may sit above the baseline's, ABSOLUTE "
                          "in nats (not relative; daemon default 0.05).")]
MinEffectOpt = Annotated[float | None, typer.Option(
    "--min-effect", help="The smallest speed-up worth having, relative: 0.02 = 2% "
                         "(daemon default); an arm that cannot reach it stops early.")]
EquivalenceOpt = Annotated[float | None, typer.Option(
    "--equivalence", help="The \"no difference\" band, relative: 0.02 = +-2%. Daemon "
                          "default: the band an A/A reaches in the budget at this node's "
                          "measured noise (the experiment shows it).")]


def _bands(body: dict[str, Any], **values: float | None) -> None:
    """The bands given on the command line into ``body`` (unset: the daemon's default)."""
    body.update({k: v for k, v in values.items() if v is not None})


@experiments_app.command()
def submit(
    name: Annotated[str, typer.Option("--name", help="The experiment's name.")],
    arms: Annotated[list[str], typer.Option(
        "--arm", help="NAME[:key=value,...], keys precision and compression.*; the first is "
                      "the baseline: --arm none --arm 'int8:compression.method=int8'.")],
    steps: Annotated[int, typer.Option("--steps", help="The budget, in optimizer steps "
                                                       "(a decided experiment stops early).")
                     ] = EXPERIMENT_STEPS,
    block_steps: Annotated[int, typer.Option("--block-steps",
                                             help="Steps per block of one arm.")] = 20,
    warmup_steps: Annotated[int | None, typer.Option(
        "--warmup-steps", help="Steps of each block not measured (daemon default 3).")] = None,
    loss_margin: LossMarginOpt = None,
    min_effect: MinEffectOpt = None,
    equivalence: EquivalenceOpt = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Base-config field: --set model.n_layers=2 (repeatable).")] = None,
    mode: Annotated[str, typer.Option(
        "--mode", help="interleaved (arms alternate in one job) or forked (each arm runs "
                       "--repeats short jobs from one checkpoint).")] = "interleaved",
    repeats: Annotated[int, typer.Option("--repeats", help="forked: trials per arm.")] = 2,
    checkpoint_run: Annotated[int | None, typer.Option(
        "--checkpoint-run", help="forked: start every trial from this run's checkpoint "
                                 "(default: a short base job makes one).")] = None,
    checkpoint_step: Annotated[int | None, typer.Option(
        "--checkpoint-step", help="forked: the step of that checkpoint.")] = None,
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
    _bands(body, loss_margin=loss_margin, min_effect=min_effect, equivalence=equivalence)
    # By ids: the daemon resolves them under its state folder (the API takes no paths).
    if checkpoint_run is not None or checkpoint_step is not None:
        body |= {"checkpoint_run": checkpoint_run, "checkpoint_step": checkpoint_step}
    e = _call("POST", url, "/api/experiments", token=read_token(token, token_file),
              json_body=body)
    _out().print(f"experiment {e['id']} {e['name']} {e['state']}: {' vs '.join(e['arms'])}"
                 + ("" if e.get("run_id") is None else f" (run {e['run_id']})"))
    _out().print(f"follow it at {url.rstrip('/')}/experiments/{e['id']}", soft_wrap=True)


@experiments_app.command("list")
def list_(url: UrlOpt = DEFAULT_URL, limit: LimitOpt = PAGE, offset: OffsetOpt = 0) -> None:
    """Experiments, newest first (a page: --limit, --offset)."""
    items = _call("GET", url, f"/api/experiments?limit={limit}&offset={offset}")
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
        ("Equivalence", band_label(e.get("equivalence"), e.get("equivalence_rule"))),
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


# --- auto-tuning and the queue ----------------------------------------------------------------


def parse_compression(text: str) -> dict[str, Any]:
    """``METHOD`` or ``METHOD:field=value,...`` with ``compression.*`` fields:
    ``int8``, ``powersgd:powersgd_rank=4``."""
    method, _, settings = text.partition(":")
    if not method.strip():
        raise typer.BadParameter(f"{text!r}: a compression needs a method "
                                 "(METHOD[:field=value,...])")
    table: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (s.strip() for s in settings.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("compression.")
        if not sep or not key or key == "method":
            raise typer.BadParameter(f"{text!r}: {item!r} is not field=value")
        table[key] = parse_value(raw.strip())
    return table


def rounds_table(t: dict[str, Any]) -> Table:
    table = Table(title="Rounds (each challenger against the best so far)", title_justify="left")
    for col in ("Stage", "Round"):
        table.add_column(col)
    table.add_column("Steps", justify="right")
    for col in ("Baseline", "Verdict per challenger"):
        table.add_column(col, overflow="fold")
    table.add_column("Experiment", justify="right")
    for r in t["rounds"]:
        verdicts, quality = r.get("verdicts"), r.get("phase") == "quality"
        if verdicts is None:
            told = ", ".join(setting_label(c) for c in r["challengers"]) + ": running"
        else:
            # Keyed by the daemon's arm names (bf16.int8), which say what they are.
            told = "\n".join(
                f"{name}: {v.get('kind', '')} {_num(v.get('ratio'), '.3f')}"
                f" [{_num(v.get('low'), '.3f')}, {_num(v.get('high'), '.3f')}]"
                + (f", quality {quality_status(v)}" if quality else "")
                for name, v in verdicts.items()) or "no verdicts (its experiment failed)"
        stage = r["stage"] + (" (quality, forked)" if quality else "")
        table.add_row(stage, str(r["index"] + 1), str(r["steps"]),
                      setting_label(r.get("baseline")), told,
                      "\u2013" if r.get("experiment_id") is None else str(r["experiment_id"]))
    return table


@experiments_app.command("autotune")
def autotune_submit(
    name: Annotated[str, typer.Option("--name", help="The search's name.")],
    precisions: Annotated[list[str] | None, typer.Option(
        "--precision", help="fp32, bf16, fp16, fp8 (repeatable; default fp32 and bf16). Those "
                            "this node cannot run are left out, with the reason.")] = None,
    compressions: Annotated[list[str] | None, typer.Option(
        "--compression", help="METHOD[:field=value,...], e.g. int8 or "
                              "'powersgd:powersgd_rank=4' (repeatable; none is always "
                              "included; default none and int8).")] = None,
    bucket_mb: Annotated[list[float] | None, typer.Option(
        "--bucket-mb", help="DDP bucket sizes to try last (repeatable).")] = None,
    mesh: Annotated[bool, typer.Option(
        "--mesh", help="Search the mesh shape first (dp x tp x pp of the job's world size, "
                       "forked trials); the later stages search on the winner's mesh.")] = False,
    steps: Annotated[int, typer.Option("--steps", help="A stage's first round's budget in "
                                       "steps per two arms (a round of k arms runs k/2 times "
                                       "as many); each later round doubles it.")] = TUNE_STEPS,
    max_rounds: Annotated[int, typer.Option("--max-rounds", help="Rounds per stage.")] = 3,
    block_steps: Annotated[int, typer.Option("--block-steps",
                                             help="Steps per block of one arm.")] = 20,
    repeats: Annotated[int, typer.Option("--repeats",
                                         help="Bucket rounds (forked): trials per arm.")] = 2,
    quality_steps: Annotated[int, typer.Option(
        "--quality-steps", help="Steps per forked trial of a stage's first quality round (each "
                                "speed winner on its own weights; 0: none).")] = TUNE_QUALITY_STEPS,
    quality_repeats: Annotated[int, typer.Option(
        "--quality-repeats", help="Quality rounds: trials per arm.")] = TUNE_QUALITY_REPEATS,
    loss_margin: LossMarginOpt = None,
    min_effect: MinEffectOpt = None,
    equivalence: EquivalenceOpt = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Base-config field: --set model.n_layers=2 (repeatable).")] = None,
    target_run: Annotated[int | None, typer.Option(
        "--target-run", help="A running job to promote the winner into.")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = Path("var/token"),
) -> None:
    """Start an auto-tuning search: the mesh shape (with --mesh), then precision, then
    compression at that precision, then the combinations those two did not try (then bucket
    size), each round an A/B experiment against the best so far."""
    body: dict[str, Any] = {"name": name, "steps": steps, "max_rounds": max_rounds,
                            "block_steps": block_steps, "repeats": repeats,
                            "quality_steps": quality_steps, "quality_repeats": quality_repeats,
                            "overrides": parse_sets(sets or []), "target_run_id": target_run,
                            "bucket_mb": list(bucket_mb or []), "mesh": mesh}
    _bands(body, loss_margin=loss_margin, min_effect=min_effect, equivalence=equivalence)
    if precisions:
        body["precisions"] = precisions
    if compressions:
        body["compressions"] = [parse_compression(c) for c in compressions]
    t = _call("POST", url, "/api/autotunes", token=read_token(token, token_file),
              json_body=body, what="auto-tune search")
    out = _out()
    target = "" if t.get("target_run_id") is None else f", promoting into run {t['target_run_id']}"
    out.print(f"auto-tune {t['id']} {t['name']} {t['state']}{target}")
    for x in t.get("infeasible") or []:
        out.print(f"  left out {x['candidate']}: {x['reason']}", soft_wrap=True)
    out.print(f"follow it at {url.rstrip('/')}/autotunes/{t['id']}", soft_wrap=True)


@experiments_app.command("autotunes")
def autotune_list(url: UrlOpt = DEFAULT_URL, limit: LimitOpt = PAGE, offset: OffsetOpt = 0
                  ) -> None:
    """Auto-tuning searches, newest first (a page: --limit, --offset)."""
    items = _call("GET", url, f"/api/autotunes?limit={limit}&offset={offset}")
    if not items:
        _out().print("no auto-tune searches yet")
        return
    table = Table(title="Auto-tune searches (newest first, times in UTC)", title_justify="left")
    table.add_column("ID", justify="right")
    for col in ("Name", "State", "Best"):
        table.add_column(col)
    table.add_column("Rounds", justify="right")
    table.add_column("Target run", justify="right")
    table.add_column("Created")
    for t in items:
        table.add_row(str(t["id"]), t["name"], t["state"], setting_label(t.get("best")),
                      str(len(t["rounds"])),
                      "\u2013" if t.get("target_run_id") is None else str(t["target_run_id"]),
                      _when(t["created_at"]))
    _out().print(table)


@experiments_app.command("autotune-show")
def autotune_show(
    tune_id: Annotated[int, typer.Argument(metavar="ID", help="The search's id.")],
    url: UrlOpt = DEFAULT_URL,
) -> None:
    """One search: state, best setting, each round's verdicts, the candidates left out and
    the promotions of its target run."""
    t = _call("GET", url, f"/api/autotunes/{tune_id}")
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for key, value in (
        ("Auto-tune", f"{t['id']} {t['name']}"), ("State", t["state"]),
        ("Best" if t["state"] != "running" else "Best so far", setting_label(t.get("best"))),
        ("Target run", "\u2013" if t.get("target_run_id") is None else str(t["target_run_id"])),
        ("Created", _when(t["created_at"])), ("Finished", _when(t.get("finished_at"))),
        ("Config", t["config_hash"]),
    ):
        head.add_row(key, value)
    if t.get("error"):
        head.add_row("Error", t["error"])
    if (t.get("best") or {}).get("needs_restart"):
        head.add_row("Not promoted", t["best"]["needs_restart"])
    out = _out()
    out.print(head)
    out.print(rounds_table(t))
    for x in t.get("infeasible") or []:
        out.print(f"left out {x['candidate']}: {x['reason']}", soft_wrap=True)
    if t.get("target_run_id") is not None:
        promos = _call("GET", url, f"/api/promotions?run_id={t['target_run_id']}")
        for p in promos:
            step = "" if p.get("applied_step") is None else f" at step {p['applied_step']}"
            reason = f" ({p['reason']})" if p.get("reason") else ""
            out.print(f"promotion {p['id']} {p['state']}{step}: {setting_label(p['setting'])} "
                      f"(was {setting_label(p['previous'])}){reason}", soft_wrap=True)


@experiments_app.command("autotune-cancel")
def autotune_cancel(
    tune_id: Annotated[int, typer.Argument(metavar="ID", help="The search's id.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = Path("var/token"),
) -> None:
    """Stop a search and the experiment of its current round."""
    t = _call("POST", url, f"/api/autotunes/{tune_id}/cancel",
              token=read_token(token, token_file))
    _out().print(f"auto-tune {t['id']} {t['name']}: {t['state']}")


def _print_queue(items: list[dict[str, Any]]) -> None:
    if not items:
        _out().print("no trials waiting")
        return
    table = Table(title="Waiting trials (claim order)", title_justify="left")
    for col in ("#", "Trial"):
        table.add_column(col, justify="right")
    for col in ("Experiment", "Arm"):
        table.add_column(col)
    table.add_column("Repeat", justify="right")
    for i, q in enumerate(items, start=1):
        table.add_row(str(i), str(q["id"]), f"{q['experiment_id']} {q['experiment']}",
                      q["arm"], str(q["repeat"] + 1))
    _out().print(table)


@experiments_app.command("queue")
def queue_list(url: UrlOpt = DEFAULT_URL, limit: LimitOpt = PAGE, offset: OffsetOpt = 0) -> None:
    """Trials waiting to be claimed, in claim order (a page: --limit, --offset)."""
    _print_queue(_call("GET", url, f"/api/queue?limit={limit}&offset={offset}"))


@experiments_app.command("reorder")
def queue_reorder(
    trial_ids: Annotated[list[int], typer.Argument(
        metavar="TRIAL...", help="Waiting trials in the order to claim them; the others keep "
                                 "their place relative to these.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = Path("var/token"),
) -> None:
    """Change the order in which waiting trials are claimed; prints the queue after."""
    _print_queue(_call("POST", url, "/api/queue/reorder", token=read_token(token, token_file),
                       json_body={"trial_ids": trial_ids}, what="order"))
