"""`traind service install|uninstall|status` as an administrator types them, into a unit folder
of the test's own; systemd itself is absent here (or hidden), which they must say plainly."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from traind.cli.service import default_traind, parse_show, quote, render_unit, template

REPO = Path(__file__).resolve().parents[2]
TRAIND = [sys.executable, "-m", "traind.cli.main", "service"]


def service(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIND_")}
    env["COLUMNS"] = "200"  # one line per message
    if path is not None:
        env["PATH"] = path
    return subprocess.run([*TRAIND, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def no_systemctl(tmp_path: Path) -> str:
    """A PATH without systemctl: the command cannot reach systemd even on a host that runs it."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    return str(empty)


def test_the_template_is_the_packaged_unit():
    assert template() == (REPO / "daemon/systemd/traind.service").read_text()


def test_render_sets_exec_user_and_group_and_keeps_everything_else():
    text = template()
    out = render_unit(text, traind=Path("/srv/tr ain/venv/bin/traind"),
                      config=Path("/etc/traind/100%.toml"), user="ml", group="gpu")
    assert 'ExecStart="/srv/tr ain/venv/bin/traind" serve --config /etc/traind/100%%.toml' in out
    assert "\nUser=ml\n" in out and "\nGroup=gpu\n" in out and "\nProtectHome=yes\n" in out
    changed = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True)
               if a != b]
    assert [a.partition("=")[0] for a, _ in changed] == ["ExecStart", "User", "Group"]


def test_a_venv_under_home_gets_read_only_home_and_no_config_means_no_flag():
    out = render_unit(template(), traind=Path("/home/ada/.venv/bin/traind"), config=None,
                      user="ada", group="ada")
    assert "\nExecStart=/home/ada/.venv/bin/traind serve\n" in out
    assert "\nProtectHome=read-only\n" in out


@pytest.mark.parametrize(("arg", "expected"), [
    ("/opt/traind/bin/traind", "/opt/traind/bin/traind"),
    ("a b", '"a b"'),
    ("$HOME", "$$HOME"),
    ('say "hi"', '"say \\"hi\\""'),
])
def test_quote(arg: str, expected: str):
    assert quote(arg) == expected


def test_parse_show():
    props = parse_show("ActiveState=active\nStatusText=serving on 0.0.0.0:8800\nMainPID=7\n")
    assert props == {"ActiveState": "active", "StatusText": "serving on 0.0.0.0:8800",
                     "MainPID": "7"}


def test_install_without_systemd_writes_the_unit_and_says_it_did_not_start(tmp_path: Path):
    units = tmp_path / "units"
    config = tmp_path / "traind.toml"
    config.write_text("")
    r = service("install", "--unit-dir", str(units), "--config", str(config), cwd=tmp_path,
                path=no_systemctl(tmp_path))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "systemctl is not installed: the unit is written but not started" in r.stderr
    assert "systemctl daemon-reload && systemctl enable --now traind.service" in r.stderr
    unit = units / "traind.service"
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert f"\nExecStart={default_traind()} serve --config {config}\n" in unit.read_text()


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="this host runs systemd")
def test_install_in_a_container_names_what_pid_1_is(tmp_path: Path):
    r = service("install", "--unit-dir", str(tmp_path), "--config", str(tmp_path / "c.toml"),
                cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "systemd is not running here (PID 1 is" in r.stderr
    assert "does not exist yet" in r.stderr  # the config: a warning, not an error
    assert (tmp_path / "traind.service").is_file()


def test_install_no_start_only_writes(tmp_path: Path):
    r = service("install", "--unit-dir", str(tmp_path), "--no-start", "--user", "nobody",
                "--group", "nogroup", cwd=tmp_path, path=no_systemctl(tmp_path))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "traind.service").read_text()
    assert "\nUser=nobody\n" in text and "\nGroup=nogroup\n" in text
    assert "start it with: systemctl daemon-reload" in r.stderr


def test_install_refuses_a_missing_traind(tmp_path: Path):
    r = service("install", "--unit-dir", str(tmp_path), "--traind", "/nonexistent/traind",
                cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "/nonexistent/traind is not an executable traind" in r.stderr
    assert not (tmp_path / "traind.service").exists()  # nothing half-done


def test_status_without_systemd_says_so(tmp_path: Path):
    r = service("status", "--unit-dir", str(tmp_path), cwd=tmp_path,
                path=no_systemctl(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "systemctl is not installed; the unit is not installed at" in r.stderr


def test_uninstall_removes_the_unit_and_is_idempotent(tmp_path: Path):
    bin_path = no_systemctl(tmp_path)
    service("install", "--unit-dir", str(tmp_path), "--no-start", cwd=tmp_path, path=bin_path)
    r = service("uninstall", "--unit-dir", str(tmp_path), cwd=tmp_path, path=bin_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "traind.service").exists()
    assert "systemctl is not installed: no service to stop" in r.stderr
    again = service("uninstall", "--unit-dir", str(tmp_path), cwd=tmp_path, path=bin_path)
    assert again.returncode == 0 and "nothing to remove" in again.stderr
