"""The link probe: rank-to-rank latency and bandwidth, point to point, at job start.

Every pair of ranks meets once, in the rounds of a round-robin tournament (``rounds``): in
each round every rank has one partner (one sits out when the count is odd), so the pairs of a
round run side by side and ``world - 1`` rounds cover the matrix, not ``world * (world - 1)
/ 2`` probes one after another. Each pair measures both directions:

- latency: an 8-byte ping-pong, half the fastest round trip, each side timing its own pings;
- bandwidth: a ``BANDWIDTH_BYTES`` message answered by an 8-byte acknowledgement (a send
  returns once the bytes are handed to the transport, not when they arrived), less one
  latency, each side timing its own sends, so an asymmetric link shows as such.

The fastest of the repeats, not the median: the link's capability is what placement needs,
and on a loaded host (ranks sharing cores) noise only ever adds time; medians measured here
put one loopback pair at a tenth of its neighbours'.

Then every rank all-gathers the rows, so all hold the same matrix: placement
(trainer/placement.py) computes the same order on each. Bounded: ``LATENCY_REPEATS`` and
``BANDWIDTH_REPEATS`` per direction after one warm-up (a slow link's warm-up is its one
measure: ``SLOW_SEND_SECONDS``), a few ms a pair on loopback gloo.
Collective: every rank calls :func:`probe_links` at the same point, before the mesh is built.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from traind.contracts.events import LinkEvent
from traind.trainer.device import device_synchronize
from traind.trainer.placement import rank_order

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.contracts.events import Event
    from traind.trainer.config import ParallelConfig
    from traind.trainer.distributed import DistInfo
    from traind.trainer.mesh import MeshShape

LATENCY_BYTES = 8
BANDWIDTH_BYTES = 1 << 20  # 1 MiB: past the transports' small-message paths, still quick
LATENCY_REPEATS = 5
BANDWIDTH_REPEATS = 3
# A bandwidth send slower than this is measured once: the probe stays within seconds on a
# slow link (repeats only sharpen the figure of a fast one, where noise is relatively large).
SLOW_SEND_SECONDS = 0.05


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """The circle method's rounds for ``n`` ranks: each a list of disjoint pairs ``(a, b)``,
    a < b; every pair exactly once over ``n - 1`` rounds (``n`` when odd: one bye each)."""
    seats: list[int | None] = [*range(n), *([None] if n % 2 else [])]
    out = []
    for _ in range(len(seats) - 1):
        half = len(seats) // 2
        pairs = [(a, b) for a, b in zip(seats[:half], reversed(seats[half:]), strict=True)
                 if a is not None and b is not None]
        out.append(sorted((min(a, b), max(a, b)) for a, b in pairs))
        seats = [seats[0], seats[-1], *seats[1:-1]]  # rank 0 stays, the rest rotate
    return out


def _timer(device: torch.device) -> Callable[[], float]:
    """Wall time after the device's queued work: NCCL's send and recv are asynchronous."""
    def now() -> float:
        device_synchronize(device)
        return time.perf_counter()
    return now


def _pair(me: int, peer: int, device: torch.device) -> tuple[float, float]:
    """(one-way latency s, bandwidth bytes/s) from ``me`` to ``peer``; ``peer`` runs the
    same call with the roles swapped."""
    now = _timer(device)
    small = torch.zeros(LATENCY_BYTES // 4, dtype=torch.float32, device=device)
    big = torch.zeros(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)
    latency = bandwidth = 0.0
    # The lower rank leads each phase, then the other: both sides' sends are timed by them.
    for lead in sorted((me, peer)):
        times = []
        for _ in range(LATENCY_REPEATS + 1):  # the first is a warm-up (connection set-up)
            if lead == me:
                t0 = now()
                dist.send(small, peer)
                dist.recv(small, peer)
                times.append(now() - t0)
            else:
                dist.recv(small, peer)
                dist.send(small, peer)
        if lead == me:
            latency = min(times[1:]) / 2
    for lead in sorted((me, peer)):
        if lead == me:
            def timed_send() -> float:
                t0 = now()
                dist.send(big, peer)
                dist.recv(small, peer)  # the acknowledgement: the bytes arrived
                return now() - t0

            first = timed_send()  # warm-up, and the measure of a slow link
            # A slow link's one send is its measure: repeats would blow the probe's bound
            # (at 10 Mbit/s one MiB takes 0.8 s). The peer is told how many follow.
            repeats = BANDWIDTH_REPEATS if first < SLOW_SEND_SECONDS else 0
            small[0] = repeats
            dist.send(small, peer)
            t = min([timed_send() for _ in range(repeats)] or [first])
            # less the acknowledgement's latency, but never more than half the time: a
            # noisy latency must not make a link look infinitely fast
            bandwidth = BANDWIDTH_BYTES / max(t - latency, t / 2)
        else:
            dist.recv(big, peer)  # the warm-up
            dist.send(small, peer)
            dist.recv(small, peer)  # how many follow
            for _ in range(int(small[0].item())):
                dist.recv(big, peer)
                dist.send(small, peer)
    return latency, bandwidth


def probe_links(rank: int, world: int, device: torch.device
                ) -> tuple[list[list[float]], list[list[float]], float]:
    """(latency, bandwidth, seconds): the ``[src][dst]`` matrices (seconds, bytes/s; zero
    on the diagonal), the same on every rank, and how long this rank's probe took."""
    t0 = time.perf_counter()
    latency, bandwidth = [0.0] * world, [0.0] * world
    for pairs in rounds(world):
        for a, b in pairs:
            if rank in (a, b):
                peer = b if rank == a else a
                latency[peer], bandwidth[peer] = _pair(rank, peer, device)
    rows: list[tuple[list[float], list[float]] | None] = [None] * world
    dist.all_gather_object(rows, (latency, bandwidth))
    seconds = time.perf_counter() - t0
    return ([list(r[0]) for r in rows if r is not None],
            [list(r[1]) for r in rows if r is not None], seconds)


def place(parallel: ParallelConfig, shape: MeshShape, info: DistInfo,
          emit: Callable[[Event], None]) -> list[int]:
    """The ranks in mesh-slot order: from the probed links with ``parallel.placement =
    "auto"``, else the identity. The probe runs with auto or ``parallel.link_probe`` (and
    more than one rank); rank 0 sends its matrix and the order as a :class:`LinkEvent`.
    Collective: every rank calls it, before the mesh is built."""
    order = list(range(info.world_size))
    if info.world_size == 1 or not (parallel.placement == "auto" or parallel.link_probe):
        return order
    latency, bandwidth, seconds = probe_links(info.rank, info.world_size, info.device)
    if parallel.placement == "auto":  # the same all-gathered matrix: the same order on all
        order = rank_order(latency, bandwidth, shape)
    if info.rank == 0:
        emit(_link_event(0, latency, bandwidth, seconds, parallel.placement, order))
    return order


def measure_again(step: int, placement: str, order: list[int], info: DistInfo,
                  emit: Callable[[Event], None]) -> None:
    """The probe on demand (the daemon asked, contracts/control.PROBE_REQUEST), between two
    steps of a running job: the matrix as it is now, in a LinkEvent at ``step`` beside the
    placement the job started with (a mesh is not rebuilt mid-run). Collective."""
    latency, bandwidth, seconds = probe_links(info.rank, info.world_size, info.device)
    if info.rank == 0:
        emit(_link_event(step, latency, bandwidth, seconds, placement, order))


def _link_event(step: int, latency: list[list[float]], bandwidth: list[list[float]],
                seconds: float, placement: str, order: list[int]) -> LinkEvent:
    """Rank 0's event of a probe (the matrix every rank holds), at start or on demand."""
    return LinkEvent(rank=0, step=step, latency=latency, bandwidth=bandwidth,
                     latency_bytes=LATENCY_BYTES, bandwidth_bytes=BANDWIDTH_BYTES,
                     seconds=seconds, placement=placement, order=order)
