"""The daemon under load while a CPU job trains: many live websockets, a slow one, steady HTTP.

    python bench/load.py --seconds 20 --clients 100
    python bench/load.py --hostile    # the hostile cases of bench/hostile.py
    python bench/load.py --hostile --only series    # one of them

Starts a real `traind serve` (a tiny CPU job that reports every step), then for ``--seconds``:
``--clients`` websocket clients on /ws/live, each timing every step message from the worker's
event time to its arrival; HTTP workers polling /api/runs and /metrics at a steady rate; and one
slow client that completes the handshake and then never reads (a tiny receive buffer). Printed:
p50/p95/max per endpoint and for websocket delivery, the daemon's RSS before, at its peak and
after, the live messages the hub dropped from clients that fell behind, and how long the
daemon held on to the slow client.

What bounds a client that never reads: the kernel's socket buffers (up to ``tcp_wmem``'s
maximum, 4 MiB here, which on loopback can take the whole run's messages), the server's
transport buffer (its high-water mark pauses our sends), the hub's per-client queue (256
messages, oldest dropped), and the websocket ping: unanswered, the daemon closes the connection
(``daemon.ws_ping_seconds``, ``--ping-seconds`` here) and frees all of it. The bench waits
for that release.
``--json PATH`` writes the same figures for tests/e2e/test_load.py, which checks only
correctness properties, never timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
from websockets.asyncio.client import connect

from traind.daemon.config import DaemonConfig

REPO = Path(__file__).resolve().parents[1]

# A very small job reporting every step on one CPU thread: on the order of a hundred steps a
# second here, each a message to every client (far more than a real job sends), so the slow
# client's socket and then its queue fill within the run.
JOB_TOML = """
[job]
name = "load"
steps = 10000000
batch_size = 4
eval_every = 100000
checkpoint_every = 1000000
threads = 1

[model]
seq_len = 32
d_model = 32
n_layers = 1
n_heads = 2

[data]
max_bytes = 2000000
"""


# Seconds to wait after the load for the daemon to let the slow client go, beyond its ping
# interval plus ping timeout from the client's connection: room for a loaded machine.
RELEASE_SLACK = 50.0
DEFAULT_PING_SECONDS: float = DaemonConfig.model_fields["ws_ping_seconds"].default


def release_limit(ping_seconds: float) -> float:
    return 2 * ping_seconds + RELEASE_SLACK


@dataclass
class Result:
    seconds: float
    clients: int
    ping_seconds: float = DEFAULT_PING_SECONDS
    latencies: dict[str, list[float]] = field(default_factory=dict)  # name -> seconds
    errors: dict[str, int] = field(default_factory=dict)  # name -> failed requests
    per_client: list[int] = field(default_factory=list)  # step messages each client got
    per_client_missed: list[int] = field(default_factory=list)  # steps skipped (its drops)
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    dropped_before: float = 0.0
    dropped_after: float = 0.0
    subscribers_peak: float = 0.0
    slow_client_read: int = 0  # bytes the slow client took in (the handshake only)
    steps_published: int = 0  # consecutive steps the reading clients saw between them
    slow_released_after: float | None = None  # seconds from its connection; None: never


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(folder: Path, ping_seconds: float = DEFAULT_PING_SECONDS,
                 ) -> tuple[subprocess.Popen[bytes], int]:
    config = folder / "traind.toml"
    config.write_text(JOB_TOML)
    port = free_port()
    log = open(folder / "daemon.log", "wb")  # noqa: SIM115 (the daemon holds it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "traind.cli.main", "serve", "--config", str(config),
         "--port", str(port), "--var-dir", str(folder / "var"),
         "--set", f"daemon.ws_ping_seconds={ping_seconds}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=folder,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"traind serve exited:\n{(folder / 'daemon.log').read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("traind serve was not ready in 120 s")


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gauge(port: int, name: str) -> float:
    """One unlabelled series' value from /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def wait_for_steps(port: int, live: str, timeout: float = 120) -> None:
    """Until the job's first step messages arrive (the worker is up and reporting)."""
    async with connect(f"ws://127.0.0.1:{port}{live}", max_size=None) as ws:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(await asyncio.wait_for(ws.recv(), timeout))
            if msg.get("type") == "step":
                return
    raise RuntimeError("no step messages from the job")


async def ws_client(port: int, live: str, until: float, delays: list[float], counts: list[int],
                    steps: list[set[int]], index: int) -> None:
    async with connect(f"ws://127.0.0.1:{port}{live}", max_size=None,
                       open_timeout=60) as ws:
        while (left := until - time.monotonic()) > 0:
            try:
                raw = await asyncio.wait_for(ws.recv(), left)
            except TimeoutError:
                return
            msg = json.loads(raw)
            if msg.get("type") == "step" and "time" in msg:
                delays.append(time.time() - msg["time"])
                counts[index] += 1
                steps[index].add(int(msg["step"]))


async def http_worker(client: httpx.AsyncClient, path: str, until: float, period: float,
                      latencies: list[float], errors: list[int]) -> None:
    """One request every ``period`` seconds (a steady rate, not as fast as it answers)."""
    next_at = time.monotonic()
    while next_at < until:
        start = time.perf_counter()
        try:
            r = await client.get(path)
            if r.status_code != 200:
                errors[0] += 1
        except httpx.HTTPError:
            errors[0] += 1
        latencies.append(time.perf_counter() - start)
        next_at += period
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def slow_client(port: int, live: str) -> tuple[socket.socket, int]:
    """A websocket that is opened and never read: a 4 KiB receive buffer, so the daemon's
    writes back up after a few frames and its per-client queue is what fills."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"GET {live} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    head = sock.recv(1024)  # the 101 and perhaps the start of the snapshot; nothing more
    if not head.startswith(b"HTTP/1.1 101"):
        raise RuntimeError(f"slow client refused: {head[:80]!r}")
    return sock, len(head)


def sample_rss(pid: int, result: Result, stop: asyncio.Event) -> asyncio.Task[None]:
    proc = psutil.Process(pid)

    async def loop() -> None:
        while not stop.is_set():
            result.rss_peak = max(result.rss_peak, proc.memory_info().rss)
            await asyncio.sleep(0.25)

    return asyncio.create_task(loop())


async def load(port: int, pid: int, seconds: float, clients: int, rate: float,
               live: str, ping_seconds: float = DEFAULT_PING_SECONDS) -> Result:
    result = Result(seconds=seconds, clients=clients, ping_seconds=ping_seconds)
    await wait_for_steps(port, live)
    await asyncio.sleep(2)  # the job's start-up allocations are not the load's
    proc = psutil.Process(pid)
    result.rss_before = result.rss_peak = proc.memory_info().rss
    result.dropped_before = await asyncio.to_thread(gauge, port, "traind_live_messages_dropped")
    slow, result.slow_client_read = slow_client(port, live)
    connected = time.monotonic()
    stop = asyncio.Event()
    sampler = sample_rss(pid, result, stop)
    until = time.monotonic() + seconds
    delays: list[float] = []
    counts = [0] * clients
    steps: list[set[int]] = [set() for _ in range(clients)]
    http_lat: dict[str, list[float]] = {"/api/runs": [], "/metrics": []}
    http_err = {path: [0] for path in http_lat}
    subscribers: list[float] = []

    async def watch_subscribers(client: httpx.AsyncClient) -> None:
        # Sampled through the run (the peak): on a loaded machine the clients connect late.
        while time.monotonic() < until:
            await asyncio.sleep(0.5)
            r = await client.get("/metrics")
            subscribers.extend(float(line.split()[1]) for line in r.text.splitlines()
                               if line.startswith("traind_live_subscribers "))

    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            tasks = [ws_client(port, live, until, delays, counts, steps, i) for i in range(clients)]
            # ``rate`` requests per second per endpoint, from two workers each.
            tasks += [http_worker(http, path, until, 2 / rate, http_lat[path], http_err[path])
                      for path in http_lat for _ in range(2)]
            await asyncio.gather(*tasks, watch_subscribers(http))
        # The reading clients are gone; the slow one stays connected (its socket open, never
        # read) until the daemon closes it for the pings it never answers.
        while time.monotonic() - connected < release_limit(ping_seconds):
            if await asyncio.to_thread(gauge, port, "traind_live_subscribers") == 0:
                result.slow_released_after = time.monotonic() - connected
                break
            await asyncio.sleep(1)
        result.dropped_after = await asyncio.to_thread(
            gauge, port, "traind_live_messages_dropped")
    finally:
        stop.set()
        await sampler
        slow.close()
    await asyncio.sleep(1)
    result.rss_after = proc.memory_info().rss
    result.latencies = {**http_lat, "websocket delivery": delays}
    result.errors = {path: n[0] for path, n in http_err.items()}
    result.per_client = counts
    # Steps are consecutive: a step some client saw and this one did not was dropped from its
    # queue (the first steps too, when 100 snapshots at once put everyone behind).
    seen = set().union(*steps)
    span = max(seen) - min(seen) + 1 if seen else 0
    result.per_client_missed = [span - len(s) for s in steps]
    result.steps_published = span
    result.subscribers_peak = max(subscribers, default=0.0)
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(r: Result) -> str:
    mib = 2**20
    rows = [f"{'what':<22} {'n':>7} {'p50 ms':>9} {'p95 ms':>9} {'max ms':>9} {'errors':>7}"]
    for name, values in r.latencies.items():
        ms = [v * 1000 for v in values]
        rows.append(f"{name:<22} {len(ms):>7} {pct(ms, 0.5):>9.1f} {pct(ms, 0.95):>9.1f} "
                    f"{max(ms, default=float('nan')):>9.1f} {r.errors.get(name, 0):>7}")
    got = r.per_client
    rows += [
        "",
        f"websocket clients      {r.clients} (+1 that never reads); step messages per client "
        f"min {min(got, default=0)} median {statistics.median(got) if got else 0:.0f} "
        f"max {max(got, default=0)}; subscribers seen {r.subscribers_peak:.0f}",
        f"daemon RSS             before {r.rss_before / mib:.1f} MiB, peak "
        f"{r.rss_peak / mib:.1f} MiB, after {r.rss_after / mib:.1f} MiB "
        f"(growth {(r.rss_peak - r.rss_before) / mib:+.1f} MiB at peak)",
        f"live messages dropped  {r.dropped_after - r.dropped_before:.0f} by the hub from "
        f"clients that fell behind; {r.steps_published} steps published under load, of which "
        f"a reading client missed {statistics.median(r.per_client_missed or [0]):.0f} "
        f"(median: connected late or dropped)",
        f"slow client            read {r.slow_client_read} bytes (the handshake); "
        + (f"let go by the daemon {r.slow_released_after:.0f} s after it connected (pings "
           "unanswered)" if r.slow_released_after is not None
           else f"STILL HELD {release_limit(r.ping_seconds):.0f} s after it connected"),
    ]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10, help="HTTP requests/s per endpoint")
    ap.add_argument("--ping-seconds", type=float, default=DEFAULT_PING_SECONDS,
                    help="the daemon's daemon.ws_ping_seconds: how soon the slow client goes")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--hostile", action="store_true",
                    help="the hostile cases instead (bench/hostile.py)")
    ap.add_argument("--submissions", type=int, default=1000, help="--hostile: API submissions")
    ap.add_argument("--trials", type=int, default=10000, help="--hostile: queued trials")
    ap.add_argument("--series-steps", type=int, default=146_000,
                    help="--hostile: the stored run the series reads read (bench/long_run.py)")
    ap.add_argument("--only", help="--hostile: only the cases whose name has this in it")
    args = ap.parse_args()
    if args.hostile:
        hostile_main(args.submissions, args.trials, args.series_steps, args.only)
        return
    with tempfile.TemporaryDirectory(prefix="traind-load-") as tmp:
        proc, port = start_daemon(Path(tmp), args.ping_seconds)
        # The websocket wants a credential: the daemon's token, as a program would send it.
        live = f"/ws/live?token={(Path(tmp) / 'var' / 'token').read_text().strip()}"
        try:
            result = asyncio.run(load(port, proc.pid, args.seconds, args.clients, args.rate,
                                      live, args.ping_seconds))
        finally:
            stop_daemon(proc)
    print(f"load for {args.seconds:.0f} s against a training daemon:\n")
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(asdict(result)))


def hostile_main(submissions: int, trials: int, series_steps: int = 146_000,
                 only: str | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from hostile import run_hostile
    from hostile import table as hostile_table
    from long_run import seed

    with tempfile.TemporaryDirectory(prefix="traind-hostile-") as tmp:
        long_run = seed(Path(tmp) / "var", steps=series_steps) if series_steps else None
        proc, port = start_daemon(Path(tmp))
        token = (Path(tmp) / "var" / "token").read_text().strip()
        try:
            cases = run_hostile(f"http://127.0.0.1:{port}", proc.pid, token,
                                submissions_n=submissions, trials=trials,
                                long_run=long_run, series_steps=series_steps, only=only)
        finally:
            stop_daemon(proc)
    print("hostile cases against a training daemon (/healthz probed every 50 ms):\n")
    print(hostile_table(cases))


if __name__ == "__main__":
    main()
