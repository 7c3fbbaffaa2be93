"""Two "nodes" on one machine: network namespaces joined by a veth pair, shaped with tc.

Used by bench/multinode.py and the multi-node tests (they put this folder on sys.path). Needs
root. Each node gets its own address on 10.77.0.0/24 (.1 and .2) and its end of the link.
"""

from __future__ import annotations

import contextlib
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

SUBNET = "10.77.0"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def two_nodes(tag: str) -> Iterator[tuple[str, str, str, str]]:
    """Namespaces ``(ns_a, ns_b)`` and their veth ends, addressed .1 and .2; removed after."""
    ns_a, ns_b, dev_a, dev_b = f"tdn{tag}a", f"tdn{tag}b", f"tdv{tag}a", f"tdv{tag}b"
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for ns, dev, host in ((ns_a, dev_a, 1), (ns_b, dev_b, 2)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, dev_a, dev_b
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace removes its veth end (and the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def shape(ns: str, dev: str, rate: str) -> None:
    """Egress of ``dev`` at ``rate`` (both ends shaped: each direction of the link)."""
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                   capture_output=True)
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
       rate, "burst", "512kb", "latency", "100ms")
