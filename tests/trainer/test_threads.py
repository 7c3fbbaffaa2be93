"""The CPUs a process may use (affinity and cgroup quota, from fake cgroup files) and the
threads a rank takes by default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from traind.trainer.threads import (
    affinity_cpus,
    cgroup_cpus,
    default_threads,
    local_ranks,
    parse_cfs,
    parse_cpu_max,
    parse_membership,
    usable,
    usable_cpus,
)


@pytest.mark.parametrize(("text", "cpus"), [
    ("max 100000\n", None),
    ("200000 100000\n", 2.0),
    ("150000 100000\n", 1.5),
    ("50000 100000", 0.5),
    ("", None), ("garbage", None), ("x 100000", None), ("100000 0", None),
])
def test_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(("quota", "period", "cpus"), [
    ("-1\n", "100000\n", None), ("300000\n", "100000\n", 3.0), ("25000", "100000", 0.25),
    ("", "100000", None),
])
def test_cfs(quota: str, period: str, cpus: float | None) -> None:
    assert parse_cfs(quota, period) == cpus


def test_membership_v1_and_v2() -> None:
    text = "12:pids:/a\n4:cpu,cpuacct:/docker/abc\n0::/user.slice/job.scope\n"
    assert parse_membership(text) == {"cpu": "/docker/abc", "": "/user.slice/job.scope"}
    assert parse_membership("") == {}


@pytest.mark.parametrize(("affinity", "quota", "cpus"), [
    (8, None, 8),  # no quota: the mask
    (8, 2.0, 2),  # a quota below the mask holds
    (2, 6.0, 2),  # a quota above it does not
    (4, 1.5, 1),  # whole CPUs only
    (4, 0.25, 1),  # at least one
    (1, None, 1),
])
def test_usable(affinity: int, quota: float | None, cpus: int) -> None:
    assert usable(affinity, quota) == cpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_of_the_processs_cgroup_and_the_tightest_above(tmp_path: Path) -> None:
    member = tmp_path / "self_cgroup"
    member.write_text("0::/app.slice/job\n")
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000\n")  # the root: no limit
    _write(root / "app.slice" / "cpu.max", "300000 100000\n")
    _write(root / "app.slice" / "job" / "cpu.max", "max 100000\n")
    assert cgroup_cpus(root, member) == 3.0  # the parent's quota caps the child's "max"
    _write(root / "app.slice" / "job" / "cpu.max", "150000 100000\n")
    assert cgroup_cpus(root, member) == 1.5


def test_v2_max_is_no_quota(tmp_path: Path) -> None:
    member = tmp_path / "self_cgroup"
    member.write_text("0::/\n")  # a container's namespace: its own cgroup is the root
    _write(tmp_path / "cg" / "cpu.max", "max 100000\n")
    assert cgroup_cpus(tmp_path / "cg", member) is None
    assert usable_cpus(tmp_path / "cg", member) == affinity_cpus()


def test_v1_cfs_quota(tmp_path: Path) -> None:
    member = tmp_path / "self_cgroup"
    member.write_text("4:cpu,cpuacct:/docker/abc\n")
    cpu = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    _write(cpu / "cpu.cfs_quota_us", "100000\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpus(tmp_path / "cg", member) == 1.0
    assert usable_cpus(tmp_path / "cg", member) == 1  # below any affinity


def test_v1_minus_one_is_no_quota_and_the_mount_root_is_read(tmp_path: Path) -> None:
    member = tmp_path / "self_cgroup"
    member.write_text("3:cpu:/\n")
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpus(tmp_path / "cg", member) is None
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_quota_us", "200000\n")
    assert cgroup_cpus(tmp_path / "cg", member) == 2.0


def test_no_cgroup_files_at_all(tmp_path: Path) -> None:
    assert cgroup_cpus(tmp_path / "none", tmp_path / "missing") is None
    assert usable_cpus(tmp_path / "none", tmp_path / "missing") == affinity_cpus() >= 1


def test_this_machine_reads_its_own_quota() -> None:
    """The real files, read a second way: the root cgroup's quota (v2 cpu.max or v1 cfs) capping
    the affinity mask, for a process whose CPU cgroup is the root."""
    membership = Path("/proc/self/cgroup")
    if not membership.is_file():
        pytest.skip("no /proc/self/cgroup on this machine")
    paths = {fields[1]: fields[2] for line in membership.read_text().splitlines()
             if len(fields := line.split(":", 2)) == 3}
    root = Path("/sys/fs/cgroup")
    if (root / "cpu.max").is_file() and paths.get("") == "/":
        q, p = (root / "cpu.max").read_text().split()
        quota = None if q == "max" else int(q) / int(p)
    elif (root / "cpu" / "cpu.cfs_quota_us").is_file() and paths.get("cpu") == "/":
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        quota = None if q < 0 else q / p
    else:
        pytest.skip("this process's CPU cgroup is not the root one: no second reading to check")
    cpus = len(os.sched_getaffinity(0))
    expected = cpus if quota is None else max(1, min(cpus, int(quota)))
    assert usable_cpus() == expected


@pytest.mark.parametrize(("env", "world", "ranks"), [
    ({"LOCAL_WORLD_SIZE": "2"}, 8, 2),  # two nodes of 2 ... or 4: this node's count
    ({}, 3, 3),  # outside torchrun: every rank counted as local
    ({"LOCAL_WORLD_SIZE": "junk"}, 2, 2),
    ({"LOCAL_WORLD_SIZE": "0"}, 2, 1),
])
def test_local_ranks(env: dict[str, str], world: int, ranks: int) -> None:
    assert local_ranks(env, default=world) == ranks


@pytest.mark.parametrize(("cpus", "ranks", "threads"), [
    (2, 2, 1), (2, 1, 2), (16, 2, 8), (16, 3, 5), (2, 4, 1), (1, 1, 1), (4, 0, 4),
])
def test_default_threads(cpus: int, ranks: int, threads: int) -> None:
    assert default_threads(cpus, ranks) == threads
