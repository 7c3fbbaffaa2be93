"""The hostile cases of ``bench/load.py --hostile``: what an attacker or a careless script does
to a training daemon, each measured by /healthz's p95 latency (probed every 50 ms meanwhile)
and the daemon's RSS before, at its peak and after.

    python bench/load.py --hostile [--submissions 1000] [--trials 10000]

1. anonymous form posts: every value the pages show, posted to every form route, no session
2. huge bodies: 100 MB posts to the API, without the token and with it
3. submissions: ``--submissions`` interleaved experiments through the API (they queue)
4. a long queue: forked experiments until ``--trials`` trials wait, then /experiments read
   over and over (it renders one page of the queue)
5. series reads: a stored run of ``--series-steps`` steps (two ranks, layers and comm, as the
   ingest writes them: bench/long_run.py), 3 rounds of 8 concurrent anonymous
   ``/api/runs/{id}/series?points=20000&ranks=true&comm=true`` (issue 40.5), after a baseline
   of as long with nothing read (what the training daemon's RSS does by itself)

Each case also reports what the daemon answered (status codes), which must all be refusals
for cases 1 and 2.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import psutil

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

MIB = 2**20


@dataclass
class Case:
    name: str
    seconds: float = 0.0
    healthz: list[float] = field(default_factory=list)
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    answers: Counter[int] = field(default_factory=Counter)


async def _measure(name: str, url: str, pid: int, work: Callable[[Case], Awaitable[None]]
                   ) -> Case:
    case = Case(name)
    proc = psutil.Process(pid)
    case.rss_before = case.rss_peak = proc.memory_info().rss
    done = asyncio.Event()

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not done.is_set():
                start = time.perf_counter()
                await c.get(url + "/healthz")
                case.healthz.append(time.perf_counter() - start)
                case.rss_peak = max(case.rss_peak, proc.memory_info().rss)
                await asyncio.sleep(0.05)

    prober = asyncio.create_task(probe())
    start = time.perf_counter()
    try:
        await work(case)
    finally:
        case.seconds = time.perf_counter() - start
        done.set()
        await prober
    case.rss_after = proc.memory_info().rss
    return case


async def anonymous_forms(url: str, case: Case) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        values: set[str] = {""}
        for page in ("/", "/experiments", "/runs", "/hardware", "/comm"):
            text = (await c.get(url + page)).text
            values |= set(re.findall(r'value="([^"]*)"', text))
            values |= set(re.findall(r'content="([^"]*)"', text))
        routes = ["/experiments", "/autotunes", "/experiments/1/cancel", "/autotunes/1/cancel",
                  "/queue/reorder", "/logout"]
        host = url.split("//", 1)[1]
        for route in routes * 20:  # 20 rounds: long enough for /healthz to be probed
            for value in sorted(values):
                for origin in ({}, {"Origin": f"http://{host}"}):
                    r = await c.post(url + route, headers=origin, data={
                        "csrf_token": value, "name": "x", "steps": "1000000000000000000",
                        "trial_ids": ["1", "2"]})
                    case.answers[r.status_code] += 1


async def huge_bodies(url: str, token: str, case: Case, *, mib: int = 100,
                      count: int = 50) -> None:
    """Declares ``mib`` MiB, sends the first MiB, then reads what the daemon says: it must
    answer (401 without the token, 413 with it) without waiting for the rest."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)

    async def one(auth: str) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write((f"POST /api/experiments HTTP/1.1\r\nHost: {host}:{port}\r\n"
                          f"Content-Type: application/json\r\n{auth}"
                          f"Content-Length: {mib * MIB}\r\n\r\n").encode() + b"[" * MIB)
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 30)
            case.answers[int(status.split()[1])] += 1
        except (OSError, TimeoutError, IndexError, ValueError):
            case.answers[0] += 1  # no answer: counted as a failure
        finally:
            writer.close()

    for auth in ("", f"Authorization: Bearer {token}\r\n"):
        await asyncio.gather(*(one(auth) for _ in range(count)))


async def submissions(url: str, token: str, case: Case, n: int) -> None:
    body = {"name": "many", "steps": 50, "block_steps": 5,
            "arms": [{"name": "a"}, {"name": "b"}]}
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {token}"}) as c:
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with sem:
                r = await c.post(url + "/api/experiments", json={**body, "name": f"many-{i}"})
                case.answers[r.status_code] += 1

        await asyncio.gather(*(one(i) for i in range(n)))


async def long_queue(url: str, token: str, case: Case, trials: int) -> None:
    per = 2 * 50  # two arms, 50 repeats (the API's most)
    body = {"name": "q", "steps": 20, "block_steps": 5, "mode": "forked", "repeats": 50,
            "arms": [{"name": "a"}, {"name": "b"}]}
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {token}"}) as c:
        for i in range(-(-trials // per)):
            r = await c.post(url + "/api/experiments", json={**body, "name": f"q-{i}"})
            case.answers[r.status_code] += 1
        sizes = []
        for _ in range(20):
            r = await c.get(url + "/experiments")
            sizes.append(len(r.content))
            case.answers[r.status_code] += 1
        case.name += f" (page {max(sizes) / 1024:.0f} KiB)"


async def series_reads(url: str, run_id: int, case: Case, *, rounds: int = 3,
                       at_once: int = 8) -> None:
    path = f"/api/runs/{run_id}/series?points=20000&ranks=true&comm=true"
    async with httpx.AsyncClient(timeout=600) as c:
        for _ in range(rounds):
            answers = await asyncio.gather(*(c.get(url + path) for _ in range(at_once)))
            for r in answers:
                case.answers[r.status_code] += 1
                if r.status_code == 200:
                    case.name = case.name.split(" (")[0] + f" ({len(r.content) / MIB:.1f} MiB)"
        await asyncio.sleep(2)  # "after": once the reads are done


def run_hostile(url: str, pid: int, token: str, *, submissions_n: int, trials: int,
                long_run: int | None = None, series_steps: int = 0,
                only: str | None = None) -> list[Case]:
    cases: list[tuple[str, Callable[[Case], Awaitable[None]]]] = [
        ("anonymous form posts", lambda c: anonymous_forms(url, c)),
        ("100 MB bodies (no token, then token)", lambda c: huge_bodies(url, token, c)),
        (f"{submissions_n} submissions", lambda c: submissions(url, token, c, submissions_n)),
        (f"{trials} queued trials, /experiments read",
         lambda c: long_queue(url, token, c, trials)),
    ]
    if long_run is not None:
        # The baseline beside it: as long, the job training, nothing read.
        cases.append(("series baseline: no reads for 120 s", lambda c: asyncio.sleep(120)))
        cases.append((f"series reads, {series_steps} steps x2 ranks",
                      lambda c: series_reads(url, long_run, c)))

    async def main() -> list[Case]:
        return [await _measure(name, url, pid, work) for name, work in cases
                if only is None or only in name]
    return asyncio.run(main())


def table(cases: list[Case]) -> str:
    rows = [f"{'case':52} {'s':>6} {'healthz p95':>12} {'max':>8} {'RSS before':>11} "
            f"{'peak':>8} {'after':>8}  answers"]
    for c in cases:
        p95 = (statistics.quantiles(c.healthz, n=20, method="inclusive")[-1]
               if len(c.healthz) > 1 else float("nan"))
        rows.append(
            f"{c.name:52} {c.seconds:6.1f} {p95 * 1e3:10.1f}ms {max(c.healthz) * 1e3:6.0f}ms "
            f"{c.rss_before / MIB:9.0f}Mi {c.rss_peak / MIB:6.0f}Mi {c.rss_after / MIB:6.0f}Mi  "
            + " ".join(f"{k}x{v}" for k, v in sorted(c.answers.items())))
    return "\n".join(rows)
