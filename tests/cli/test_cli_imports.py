"""The CLI is a client: importing any of its modules loads neither the database engine nor the
web layer. Each module is imported in a fresh interpreter, so what another test imported first
cannot hide an edge. ``traind serve`` reaches the daemon (and through it both) only inside its
command, which these imports do not run."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import traind.cli

FORBIDDEN = ("sqlalchemy", "fastapi", "traind.web", "traind.daemon.db", "traind.daemon.node")
MODULES = ["traind.cli", *sorted(m.name for m in pkgutil.walk_packages(traind.cli.__path__,
                                                                       "traind.cli."))]

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def forbidden(loaded: list[str]) -> list[str]:
    """The loaded modules that are, or sit inside, a forbidden package."""
    return [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_every_cli_module_is_checked() -> None:
    # A module added to cli/ is picked up by the walk; this guards the walk itself.
    assert {"traind.cli.main", "traind.cli.experiments", "traind.cli.service",
            "traind.cli.grafana", "traind.cli.foreground", "traind.cli.console"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_cli_module_imports_no_engine_and_no_web(module: str) -> None:
    r = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True,
                       check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert forbidden(json.loads(r.stdout)) == []


@pytest.mark.parametrize(("loaded", "found"), [
    (["traind.web", "traind.web.views"], ["traind.web", "traind.web.views"]),
    (["sqlalchemy.engine", "traind.daemon.db.engine"], ["sqlalchemy.engine",
                                                        "traind.daemon.db.engine"]),
    (["traind.webhooks", "traind.daemon.dbx", "fastapi_offline", "traind.daemon.config"], []),
])
def test_forbidden_matches_packages_not_prefixes(loaded: list[str], found: list[str]) -> None:
    assert forbidden(loaded) == found
