"""docker/ as far as it can be checked without Docker: the compose stack is well formed and
mounts files that exist, Prometheus accepts its config and rules, the image runs traind serve."""

from __future__ import annotations

import re
import subprocess
from typing import TYPE_CHECKING

import pytest

from tests.conftest import REPO

if TYPE_CHECKING:
    from pathlib import Path

yaml = pytest.importorskip("yaml", reason="pip install 'traind[test]' (PyYAML)")

DOCKER = REPO / "docker"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount (named volumes have no ``/`` or ``.``)."""
    out = []
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith((".", "/")):
            out.append(((DOCKER / src).resolve(), dst))
    return out


def test_compose_has_the_three_services_and_their_mounts_exist():
    stack = compose()
    assert set(stack["services"]) == {"traind", "prometheus", "grafana"}
    for name, svc in stack["services"].items():
        for host, _ in bind_mounts(svc):
            assert host.exists(), f"{name} mounts {host}, which is not in the repository"
    traind = stack["services"]["traind"]
    assert (DOCKER / traind["build"]["context"] / traind["build"]["dockerfile"]).resolve() \
        == DOCKER / "Dockerfile"
    assert any(p.endswith(":8800") for p in traind["ports"])
    assert any(v.endswith(":/var/lib/traind") for v in traind["volumes"])
    named = {v.split(":")[0] for s in stack["services"].values() for v in s.get("volumes", [])
             if not v.startswith((".", "/"))}
    assert named <= set(stack["volumes"])


def test_grafana_mounts_match_its_provisioning():
    grafana = compose()["services"]["grafana"]
    mounts = {dst: host for host, dst in bind_mounts(grafana)}
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards/traind.yaml").read_text())
    dash_path = provider["providers"][0]["options"]["path"]
    assert list(mounts[dash_path].glob("*.json")), f"no dashboards mounted at {dash_path}"


def test_prometheus_scrapes_traind_and_loads_the_rules():
    prom = compose()["services"]["prometheus"]
    mounts = {dst: host for host, dst in bind_mounts(prom)}
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for sc in jobs["traind"]["static_configs"] for t in sc["targets"]]
    assert targets == ["traind:8800"] and jobs["traind"].get("metrics_path") == "/metrics"
    # rule_files are relative to the config file, in the container as in the repository.
    for rule_file in config["rule_files"]:
        assert f"/etc/prometheus/{rule_file}" in mounts


def test_promtool_checks_the_config_and_its_rules(promtool_bin: str):
    r = subprocess.run([promtool_bin, "check", "config", str(DOCKER / "prometheus/prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"SUCCESS: \d+ rules found", r.stdout), r.stdout


def instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        out.append(current)
        current = ""
    return out


def test_dockerfile_takes_a_base_image_and_runs_traind_serve():
    text = (DOCKER / "Dockerfile").read_text()
    lines = instructions(text)
    assert lines.index("ARG BASE_IMAGE=python:3.11-slim") < lines.index("FROM ${BASE_IMAGE}")
    entrypoint = [ln for ln in lines if ln.startswith("ENTRYPOINT ")][-1]
    cmd = [ln for ln in lines if ln.startswith("CMD ")][-1]  # docker uses the last one
    assert entrypoint == 'ENTRYPOINT ["traind"]'
    assert cmd.startswith('CMD ["serve"') and '"0.0.0.0"' in cmd
    assert "ARG TORCH_VERSION=2.13.0" in lines and "torch==${TORCH_VERSION}" in text
    assert "EXPOSE 8800" in lines and "USER traind" in lines


def test_the_gpu_override_asks_for_nvidia_devices():
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())
    devices = gpu["services"]["traind"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
