"""``traind service install|uninstall|status``: traind as a systemd service on this node.

The unit shipped in ``daemon/systemd/traind.service`` is a working unit for a venv in
/opt/traind; ``install`` writes it with this installation's ``traind``, the config path and the
user filled in, then asks systemd to load and start it. Where systemd is not running (a
container, a laptop without it) the unit is still written and the command says what to run.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from traind.cli.console import fail

UNIT = "traind.service"
STATE_DIR = Path("/var/lib/traind")  # StateDirectory=traind, the service user's home
SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "UnitFileState", "MainPID",
                   "NRestarts", "StatusText", "WatchdogUSec", "ExecMainStartTimestamp",
                   "FragmentPath")
# Where a venv is unreadable under ProtectHome=yes (the unit then uses read-only).
HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))

service_app = typer.Typer(help="Run traind as a systemd service on this node.",
                          no_args_is_help=True)
console = Console(stderr=True)

UnitDirOpt = Annotated[Path, typer.Option(
    help="Where the unit file goes (a different folder is for tests and packaging).")]


def template() -> str:
    return (resources.files("traind.daemon") / "systemd" / UNIT).read_text()


def quote(arg: str) -> str:
    """One ExecStart argument as systemd parses it: ``%`` and ``$`` are its specifier and
    variable signs, and whitespace or quotes need double quotes."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if re.search(r"[\s\"'\\;]", arg):
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def render_unit(text: str, *, traind: Path, config: Path | None, user: str, group: str) -> str:
    """The unit with ExecStart, User, Group (and ProtectHome for a venv under /home) set.

    Pure: each of those keys is replaced where the template sets it, every other line and
    comment stays as shipped."""
    argv = [str(traind), "serve"] + (["--config", str(config)] if config else [])
    under_home = any(traind.is_relative_to(h) for h in HOME_ROOTS)
    values = {"ExecStart": " ".join(quote(a) for a in argv), "User": user, "Group": group,
              "ProtectHome": "read-only" if under_home else "yes"}
    lines = []
    for line in text.splitlines():
        key = line.partition("=")[0]
        if key in values and not line.startswith("#"):
            line = f"{key}={values.pop(key)}"
        lines.append(line)
    assert not values, f"the unit template lost its {sorted(values)} lines"
    return "\n".join(lines) + "\n"


def default_traind() -> Path:
    """This installation's ``traind`` (beside the running interpreter, as a venv puts it)."""
    beside = Path(sys.executable).parent / "traind"
    if beside.is_file():
        return beside.absolute()
    found = shutil.which("traind")
    return Path(found).absolute() if found else beside


def systemd_missing() -> str | None:
    """Why systemctl cannot be used here, or None when it can."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed"
    if not os.path.isdir("/run/systemd/system"):  # sd_booted()'s test
        try:
            init = Path("/proc/1/comm").read_text().strip()
        except OSError:
            init = "unknown"
        return f"systemd is not running here (PID 1 is {init!r}; a container?)"
    return None


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show`` output (``Key=value`` lines) as a dict."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120)


def _fail(msg: str, code: int = 1) -> typer.Exit:
    return fail(msg, code)


def _run_or_fail(*args: str) -> None:
    r = _systemctl(*args)
    if r.returncode != 0:
        raise _fail(f"systemctl {' '.join(args)} failed ({r.returncode}): "
                    f"{(r.stderr or r.stdout).strip()}", r.returncode)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _create_user(name: str) -> None:
    if _user_exists(name):
        console.print(f"user {name} exists", highlight=False)
        return
    useradd = shutil.which("useradd")
    if useradd is None:
        raise _fail("useradd is not installed: create the user yourself, or pass an existing "
                    "one with --user")
    r = subprocess.run([useradd, "--system", "--user-group", "--home-dir", str(STATE_DIR),
                        "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise _fail(f"useradd {name} failed ({r.returncode}): {r.stderr.strip()} "
                    "(creating a user needs root)")
    console.print(f"created system user {name}", highlight=False)


@service_app.command()
def install(
    config: Annotated[Path | None, typer.Option(
        help="The TOML config the service reads (absolute; none = defaults and "
             "TRAIND_* variables from a drop-in).")] = Path("/etc/traind/traind.toml"),
    user: Annotated[str, typer.Option(help="The user the daemon runs as.")] = "traind",
    group: Annotated[str | None, typer.Option(help="Its group (default: same as user).")] = None,
    create_user: Annotated[bool, typer.Option(
        "--create-user", help="Create the user (useradd --system) if it does not exist.")
    ] = False,
    traind: Annotated[Path | None, typer.Option(
        help="The traind executable for ExecStart (default: this installation's).")] = None,
    unit_dir: UnitDirOpt = Path("/etc/systemd/system"),
    no_start: Annotated[bool, typer.Option(
        "--no-start", help="Only write the unit; do not enable or start it.")] = False,
) -> None:
    """Write the systemd unit, then daemon-reload and enable --now it."""
    exe = (traind or default_traind()).absolute()
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise _fail(f"{exe} is not an executable traind: pass --traind PATH")
    if config is not None:
        config = config.absolute()
        if not config.is_file():
            console.print(f"[yellow]warning:[/] {config} does not exist yet: the service will "
                          "not start until it does", highlight=False)
    if create_user:
        _create_user(user)
    elif not _user_exists(user):
        console.print(f"[yellow]warning:[/] user {user} does not exist: pass --create-user",
                      highlight=False)
    unit = render_unit(template(), traind=exe, config=config, user=user, group=group or user)
    path = unit_dir / UNIT
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{UNIT}.tmp")
        tmp.write_text(unit)
        tmp.chmod(0o644)
        tmp.replace(path)  # atomic: systemd never reads half a unit
    except PermissionError:
        raise _fail(f"cannot write {path}: run as root (sudo {exe} service install)") from None
    console.print(f"wrote {path}", highlight=False)
    start = f"systemctl daemon-reload && systemctl enable --now {UNIT}"
    if no_start:
        console.print(f"start it with: {start}", highlight=False)
        return
    if (why := systemd_missing()) is not None:
        raise _fail(f"{why}: the unit is written but not started. On a host running systemd: "
                    f"{start}")
    _run_or_fail("daemon-reload")
    _run_or_fail("enable", "--now", UNIT)
    console.print(f"{UNIT} enabled and started; follow it with: journalctl -u traind -f",
                  highlight=False)


@service_app.command()
def uninstall(unit_dir: UnitDirOpt = Path("/etc/systemd/system")) -> None:
    """Stop, disable and remove the unit (the state in /var/lib/traind and the user stay)."""
    path = unit_dir / UNIT
    why = systemd_missing()
    if why is None:
        r = _systemctl("disable", "--now", UNIT)
        if r.returncode != 0 and path.exists():
            raise _fail(f"systemctl disable --now {UNIT} failed ({r.returncode}): "
                        f"{(r.stderr or r.stdout).strip()}", r.returncode)
    try:
        path.unlink(missing_ok=False)
        console.print(f"removed {path}", highlight=False)
    except FileNotFoundError:
        console.print(f"{path} is not there: nothing to remove", highlight=False)
    except PermissionError:
        raise _fail(f"cannot remove {path}: run as root") from None
    if why is None:
        _run_or_fail("daemon-reload")
    else:
        console.print(f"{why}: no service to stop", highlight=False)


@service_app.command()
def status(unit_dir: UnitDirOpt = Path("/etc/systemd/system")) -> None:
    """The service as systemd sees it (systemctl show); exit 0 only when it is active."""
    path = unit_dir / UNIT
    if (why := systemd_missing()) is not None:
        there = "installed" if path.is_file() else "not installed"
        raise _fail(f"{why}; the unit is {there} at {path}")
    r = _systemctl("show", UNIT, f"--property={','.join(SHOW_PROPERTIES)}")
    if r.returncode != 0:
        raise _fail(f"systemctl show {UNIT} failed ({r.returncode}): {r.stderr.strip()}",
                    r.returncode)
    props = parse_show(r.stdout)
    table = Table(title=UNIT, show_header=False)
    for key in SHOW_PROPERTIES:
        table.add_row(key, props.get(key, ""))
    Console().print(table)
    if props.get("ActiveState") != "active":
        raise typer.Exit(3)  # what `systemctl is-active` returns for a unit not running
