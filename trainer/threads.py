"""The CPUs this process may use, and the intra-op threads a rank takes by default.

One home for the count: the trainer sizes its thread pool with it, the daemon's admission
checks jobs against it, and the host collector compares the runnable threads with it (the
daemon hands it the function: metrics never import the trainer).

Why not ``torch.get_num_threads()`` divided by the world size (the old rule): torch counts the
host's cores, blind to a cgroup's CPU quota (a container given 2 CPUs of a 64-core host made 64
threads), and the world size counts ranks on every node while only this node's share its CPUs.
Under outside load two threads per rank on 2 cores fell from ~22,000 to 64-350 tokens/s (issue
14); the threads of every rank on a node must fit its CPUs.

Reading (the files) is separate from parsing (pure, tested with tables of file contents); no
torch here, so the daemon may call it without loading anything.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"quota period"``, quota ``max`` for none) as CPUs, or None."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _ratio(parts[0], parts[1])


def parse_cfs(quota: str, period: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` as CPUs; None when the quota
    is ``-1`` (none)."""
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # a file we do not understand limits nothing
    return q / p if q > 0 and p > 0 else None


def parse_membership(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> path: ``""`` for the v2 unified hierarchy
    (``0::/path``), ``"cpu"`` for v1's CPU controller (``4:cpu,cpuacct:/path``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep:
            continue
        if controllers == "":
            out.setdefault("", path)
        elif "cpu" in controllers.split(","):
            out.setdefault("cpu", path)
    return out


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base/path`` and every folder above it up to ``base``: a parent's quota caps its
    children's, so the tightest one on the way up is the one that holds."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpus(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> float | None:
    """The CPU quota of this process's cgroup (v2 or v1, the tightest on its path), in CPUs;
    None when there is none (or no cgroup file system). Inside a container the cgroup
    namespace makes the path ``/``, so the root's own files are read then."""
    member = parse_membership(_read(membership) or "")
    found: list[float] = []
    for folder in _ancestors(root, member.get("", "/")):  # v2
        text = _read(folder / "cpu.max")
        if text is not None and (cpus := parse_cpu_max(text)) is not None:
            found.append(cpus)
    for mount in ("cpu", "cpu,cpuacct"):  # v1: the controller's own mount
        for folder in _ancestors(root / mount, member.get("cpu", "/")):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota is not None and period is not None and (
                    cpus := parse_cfs(quota, period)) is not None:
                found.append(cpus)
    return min(found, default=None)


def affinity_cpus() -> int:
    """The CPUs the scheduler may run this process on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # macOS has no affinity call


def usable(affinity: int, quota: float | None) -> int:
    """CPUs to plan for: the affinity mask, capped by the quota's whole CPUs, at least 1
    (a quota of 1.5 CPUs keeps 2 threads busy only 75% of the time: plan for 1)."""
    cpus = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cpus)


def usable_cpus(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's CPU quota."""
    return usable(affinity_cpus(), cgroup_cpus(root, membership))


def local_ranks(env: Mapping[str, str], default: int) -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``; ``default`` (the caller passes
    the world size: counting every rank as local never oversubscribes) without it."""
    try:
        return max(1, int(env["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return max(1, default)


def default_threads(cpus: int, ranks: int) -> int:
    """Intra-op threads per rank when ``job.threads`` is 0: this node's usable CPUs shared
    among its ranks, at least 1 each."""
    return max(1, cpus // max(1, ranks))

