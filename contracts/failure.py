"""How a rank says why it failed, in one line the launcher's log keeps.

A failed job's log holds every rank's traceback and then torchrun's own (``ChildFailedError``,
40 lines that name no error); two ranks' lines interleave, so which error was whose is lost.
So each rank's last line before it exits with an error is :func:`line`: its rank and its
error's first line. The daemon and ``traind run`` find them with :func:`errors` and show the
failed rank's, in one line, with the log for the rest.
"""

from __future__ import annotations

import re

PREFIX = "traind worker rank "
_LINE = re.compile(rf"^{re.escape(PREFIX)}(?P<rank>\d+) failed: (?P<error>.*)$", re.MULTILINE)


def line(rank: int, exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    return f"{PREFIX}{rank} failed: {type(exc).__name__}" + (f": {first}" if first else "")


# What a rank says when a peer died under it: the consequence, never the cause. torchrun's
# "first observed failure" is a race between the two (the peer's collective fails within the
# same instant), so a rank whose error reads like this yields to one whose error does not.
_PEER_GONE = re.compile(
    r"connection (closed|reset) by peer|remote worker crash|broken pipe|"
    r"NCCL communicator was aborted|watchdog caught collective operation timeout", re.I)


def peer_gone(error: str) -> bool:
    return bool(_PEER_GONE.search(error))


def errors(log: str) -> dict[int, str]:
    """Each rank's error in ``log`` (its last, where a rank wrote more than one)."""
    return {int(m["rank"]): m["error"].strip() for m in _LINE.finditer(log)}
