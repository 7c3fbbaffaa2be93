"""Fixtures shared by every test folder: real parts (skip here, fail in CI) and a live daemon."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest

# Triton's interpreter for the whole session, set before anything imports triton: triton
# decorates its own library functions (tl.sum, tl.max...) when triton.language is imported,
# and torchao or inductor import it long before tests/kernels' conftest runs; library
# functions built for the compiler then refuse to run inside an interpreted kernel. No test
# here runs triton any other way (no GPU; inductor's CPU code is C++).
os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"


def require_real_part(path_or_cmd: str, how: str) -> str:
    """The executable, or skip with how to install it; in CI a missing part fails the run."""
    found = path_or_cmd if os.access(path_or_cmd, os.X_OK) else shutil.which(path_or_cmd)
    if found:
        return found
    msg = f"{path_or_cmd} is not installed ({how})"
    if IN_CI:
        pytest.fail(f"CI=true and {msg}")
    pytest.skip(msg)


@contextlib.contextmanager
def running_prometheus(prometheus_bin: str, config: Path, tsdb: Path, log: Path
                       ) -> Iterator[str]:
    """A real Prometheus on ``config`` and ``tsdb`` (its output in ``log``): its URL once it
    answers ready; stopped when the block ends."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # start-up, not a figure under test
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready:\n{log.read_text()}"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TINY_TOML = """
[job]
name = "e2e"
steps = {steps}
batch_size = 8
eval_every = 20
eval_batches = 2
checkpoint_every = 100
threads = 1

[model]
seq_len = 64
d_model = 64
n_layers = 2
n_heads = 4

[data]
max_bytes = 2000000

[optim]
lr = 0.003
warmup_steps = 10
"""


@dataclass
class DaemonProc:
    url: str
    port: int
    var_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)  # type: ignore[arg-type]


def start_daemon(tmp: Path, *, steps: int = 400, sets: tuple[str, ...] = ()) -> DaemonProc:
    """`traind serve` on a free port with the tiny config, plus ``--set`` overrides."""
    config = tmp / "traind.toml"
    config.write_text(TINY_TOML.format(steps=steps))
    port = free_port()
    log = tmp / "daemon.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "traind.cli.main", "serve", "--config", str(config),
         "--port", str(port), "--var-dir", str(tmp / "var"),
         *(arg for kv in sets for arg in ("--set", kv))],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp,  # noqa: SIM115
    )
    d = DaemonProc(url=f"http://127.0.0.1:{port}", port=port, var_dir=tmp / "var", proc=proc,
                   log=log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"traind serve exited {proc.returncode}:\n{log.read_text()}")
        try:
            if d.get("/healthz").status_code == 200:
                return d
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_daemon(d)
    raise AssertionError(f"traind serve was not ready in 90 s:\n{log.read_text()}")


def stop_daemon(d: DaemonProc) -> None:
    if d.proc.poll() is None:
        d.proc.terminate()
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()


def job_workers(d: DaemonProc) -> list[psutil.Process]:
    """The worker ranks of the daemon's jobs (torchrun's children running the trainer; not
    torchrun itself, whose command line names the worker module too)."""
    procs = []
    for p in psutil.Process(d.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            if "traind.trainer.worker" in cmd and "torch.distributed.run" not in cmd:
                procs.append(p)
    return procs


def signal_workers(d: DaemonProc, sig: signal.Signals) -> int:
    """Send ``sig`` to every worker rank of the daemon; how many got it."""
    sent = 0
    for p in job_workers(d):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
            sent += 1
    return sent


def wait_for_first_step(d: DaemonProc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert d.proc.poll() is None, f"traind serve exited:\n{d.log.read_text()[-3000:]}"
        if "\ntraind_train_steps_total{" in d.get("/metrics").text and job_workers(d):
            return
        time.sleep(0.5)
    raise AssertionError(f"no training step within {timeout} s:\n{d.log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def _shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    # Enough steps to still be training when the last test that shares it looks; between
    # tests its worker is stopped (SIGSTOP), so it costs the rest of the suite no CPU.
    d = start_daemon(tmp_path_factory.mktemp("daemon"), steps=1_000_000)
    try:
        wait_for_first_step(d)
        signal_workers(d, signal.SIGSTOP)
        yield d
    finally:
        signal_workers(d, signal.SIGCONT)  # a stopped rank could not checkpoint on SIGTERM
        stop_daemon(d)


@pytest.fixture
def daemon(_shared_daemon: DaemonProc) -> Iterator[DaemonProc]:
    """One `traind serve` subprocess shared by the end-to-end tests (start-up costs seconds),
    whose job trains only while a test that uses it runs."""
    signal_workers(_shared_daemon, signal.SIGCONT)
    try:
        yield _shared_daemon
    finally:
        signal_workers(_shared_daemon, signal.SIGSTOP)


@pytest.fixture
def output_dir() -> Path:
    """Where tests leave files for people to look at (screenshots): git-ignored."""
    out = REPO / "test-output"
    out.mkdir(exist_ok=True)
    return out


@pytest.fixture
def prometheus_bin() -> str:
    return require_real_part("prometheus", "apt-get install prometheus, or run `make test` as root")


@pytest.fixture
def fresh_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    """A daemon of the test's own, whose first scrapes see the first steps."""
    d = start_daemon(tmp_path, steps=400)
    yield d
    stop_daemon(d)


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",  # this machine's closed network refuses them otherwise
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Debian's chromium driven by Playwright (never `playwright install`)."""
    executable = require_real_part("/usr/bin/chromium",
                                   "apt-get install chromium, or run `make test` as root")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonProc]]:
    """``make(tmp, steps=..., sets=(...))`` starts a daemon; all are stopped when the test
    ends (none trains on behind later tests)."""
    started: list[DaemonProc] = []

    def make(tmp: Path, **kw: Any) -> DaemonProc:
        d = start_daemon(tmp, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        stop_daemon(d)


@pytest.fixture
def promtool_bin() -> str:
    return require_real_part("promtool", "apt-get install prometheus (ships promtool)")


# The PostgreSQL fixtures, for every folder (imported last: tests/postgres.py uses the helpers
# above).
from tests.postgres import (  # noqa: E402, F401
    fresh_postgres_url,
    postgres_server,
    postgres_url,
)


def browser_log_in(page: Any, base_url: str, token: str) -> None:
    """Log a Playwright page in at /login with the daemon's token, as a user does."""
    page.goto(base_url + "/login")
    page.fill('#login input[name="token"]', token)
    with page.expect_navigation():
        page.click('#login button[type="submit"]')
    assert "/login" not in page.url, page.content()[:2000]


def wait_until(page: Any, expression: str, timeout: float = 10_000) -> None:
    """Poll a JavaScript expression until it is truthy (``timeout`` in ms, as Playwright's).

    Not ``page.wait_for_function``: that compiles the expression inside the page with
    ``new Function``, which the daemon's CSP (no 'unsafe-eval') rightly refuses; and a
    ``bypass_csp`` context would hide a violation of the pages' own scripts from the tests.
    """
    deadline = time.monotonic() + timeout / 1000
    while not _evaluate_across_reloads(page, expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout / 1000:.0f} s: {expression}")
        page.wait_for_timeout(100)


def _evaluate_across_reloads(page: Any, expression: str) -> Any:
    try:
        return page.evaluate(expression)
    except Exception as exc:  # a page that reloads itself: ask again once it has
        if "context was destroyed" not in str(exc) and "navigat" not in str(exc):
            raise
        return False


@contextlib.contextmanager
def watched_page(browser: Any, width: int = 1440, height: int = 900
                 ) -> Iterator[tuple[Any, list[str]]]:
    """A new Playwright page and the list its script errors and CSP refusals go to (the
    test asserts it empty); the page is closed at the end, whatever happened."""
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    watch_csp(page, errors)
    try:
        yield page, errors
    finally:
        page.close()


def watch_csp(page: Any, errors: list[str]) -> None:
    """Add every Content-Security-Policy refusal the page logs to ``errors``."""
    page.on("console", lambda m: errors.append(m.text)
            if m.type == "error" and "Content Security Policy" in m.text else None)
