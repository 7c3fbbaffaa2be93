"""A real Prometheus (Debian's package) scrapes the daemon; the loss comes back through its
HTTP query API."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prometheus_scrapes_the_loss(daemon, prometheus_bin: str, tmp_path: Path):
    port = _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: traind\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{daemon.port}']\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        deadline = time.monotonic() + 90
        result: list = []
        while time.monotonic() < deadline and not result:
            time.sleep(1)
            try:
                r = httpx.get(f"{api}/query", params={"query": "traind_train_loss"}, timeout=5)
            except httpx.TransportError:
                continue
            if r.status_code == 200:
                result = r.json()["data"]["result"]
        assert result, (tmp_path / "prometheus.log").read_text()[-3000:]
        sample = result[0]
        assert sample["metric"]["job"] == "traind"
        assert sample["metric"]["run"] and sample["metric"]["rank"] == "0"
        assert float(sample["value"][1]) > 0
        # The target is healthy and a range query returns a series over time.
        targets = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
        assert targets[0]["health"] == "up", targets
        time.sleep(3)
        now = time.time()
        r = httpx.get(f"{api}/query_range", params={
            "query": "traind_train_loss", "start": now - 60, "end": now, "step": "1s"}, timeout=5)
        assert len(r.json()["data"]["result"][0]["values"]) >= 2
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
