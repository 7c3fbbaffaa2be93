"""Optional parts: the import table agrees with pyproject's extras, and a missing one is one
clear line (the CLI prints it and exits 2, with no traceback)."""

from __future__ import annotations

import re
import sys
import tomllib

import pytest

from tests.conftest import REPO
from traind import extras
from traind.cli import main as cli

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OPTIONAL = PYPROJECT["project"]["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


@pytest.mark.parametrize("module", sorted(extras.EXTRAS))
def test_every_optional_import_names_an_extra_that_brings_it(module: str) -> None:
    extra = extras.EXTRAS[module]
    assert extra.name in OPTIONAL, f"pyproject has no extra {extra.name!r}"
    assert extra.package.lower() in _names(OPTIONAL[extra.name]) | {
        # psycopg[binary] and the OTLP exporter are named as pip names them
        n.split("[")[0] for n in _names(OPTIONAL[extra.name])}
    # and it is not a runtime dependency (then it would not be optional)
    assert extra.package.lower() not in _names(PYPROJECT["project"]["dependencies"])


def test_the_test_extra_installs_what_the_tests_import() -> None:
    # The suite runs the Triton kernels, pushes to Grafana, runs on PostgreSQL and trains
    # fp8 in torchao's emulation.
    test = " ".join(OPTIONAL["test"])
    for extra in ("grafana", "postgres", "kernels", "fp8"):
        assert extra in test


def test_torchao_is_pinned_to_the_release_tested_with_torch() -> None:
    # torchao's float8 training reaches into torch internals; a release built for another
    # torch fails at import or in its kernels, so the extra names one exact version.
    (requirement,) = OPTIONAL["fp8"]
    assert re.fullmatch(r"torchao==\d+\.\d+\.\d+", requirement), requirement


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grafana_client", None)  # import raises ModuleNotFoundError
    assert not extras.available("grafana_client") or "grafana_client" in sys.modules
    with pytest.raises(extras.MissingExtra) as info:
        extras.require("grafana_client")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == ("pushing dashboards to Grafana needs grafana-client, which is not installed: "
                   "pip install 'traind[grafana]' (or grafana-client)")


def test_a_broken_install_is_not_mistaken_for_a_missing_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> None:
        raise ModuleNotFoundError("No module named 'niquests'", name="niquests")

    monkeypatch.setattr(extras.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="niquests"):
        extras.require("grafana_client")


def test_an_unknown_module_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match="no traind extra"):
        extras.require("numpy")


def test_the_cli_prints_the_line_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "grafana_client", None)
    monkeypatch.setattr(sys, "argv", ["traind", "grafana", "push", "--url",
                                      "http://127.0.0.1:9", "--token", "t"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "pip install 'traind[grafana]'" in err
    assert len(err.strip().splitlines()) <= 2  # one line, wrapped at most once by the terminal


def test_a_postgresql_url_without_psycopg_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from traind.daemon.db.engine import make_engine

    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(extras.MissingExtra, match=r"pip install 'traind\[postgres\]'"):
        make_engine("postgresql+psycopg://traind@localhost/traind")


def test_the_docker_image_installs_the_fp8_extra() -> None:
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert "ARG TRAIND_EXTRAS=fp8" in text
    assert 'pip install "/src/traind[${TRAIND_EXTRAS}]"' in text
