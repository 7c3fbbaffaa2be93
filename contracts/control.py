"""Settings the daemon hands a running job: a control file read at checkpoint boundaries.

The daemon writes ``<out_dir>/control.json`` atomically (temp file + rename) as
``{"seq": n, "setting": {"precision": ..., "compression": {...}}}``; the job applies a message
whose ``seq`` it has not applied yet, right after a checkpoint (so the checkpoint before the
change is the state a rollback returns to) and once at start (a resumed job takes the
latest setting again: its config file still holds the original). Rank 0 reads the file and
broadcasts it, so every rank switches at the same step even if the file changes between reads.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILENAME = "control.json"
# The daemon asks a running job to probe its links again (``POST /api/runs/{id}/probe-links``)
# by creating ``<out_dir>/probe-links.request``; rank 0 looks for it on report steps, the ranks
# agree in the all-reduce they already make there, probe, and rank 0 removes it.
PROBE_REQUEST = "probe-links.request"
# The daemon asks a running job for a profile (``POST /api/runs/{id}/profile``) by writing
# ``<out_dir>/profile.request`` (a ProfileRequest, atomically); rank 0 looks for it on report
# steps like the probe's, the ranks agree, rank 0 reads it, hands it to every rank and removes
# it. The chosen ranks then trace ``steps`` steps into ``profiles/<capture>/`` (PROFILE_DIR).
PROFILE_REQUEST = "profile.request"
PROFILE_DIR = "profiles"
PROFILE_STEPS_MAX = 50  # a trace of more steps is hundreds of MB and minutes to analyse


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    capture: int  # the capture's id within its run (its folder: profiles/<capture>)
    steps: int
    ranks: tuple[int, ...] | None = None  # None: every rank

    def __post_init__(self) -> None:
        if problems := request_problems(self.capture, self.steps, self.ranks):
            raise ValueError("; ".join(f"{name}: {why}" for name, why in problems))

    def chooses(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def request_problems(capture: int, steps: int, ranks: tuple[int, ...] | None
                     ) -> list[tuple[str, str]]:
    """What is wrong with a profile request, as (field, reason) pairs: the one rule, which the
    daemon checks before it asks and a job when it reads a request."""
    out = []
    if not 1 <= steps <= PROFILE_STEPS_MAX:
        out.append(("steps", f"between 1 and {PROFILE_STEPS_MAX} (not {steps})"))
    if capture < 1:
        out.append(("capture", f"a positive id (not {capture})"))
    if ranks is not None and (not ranks or min(ranks) < 0):
        out.append(("ranks", f"rank numbers, 0 or more (not {list(ranks)})"))
    return out


def read_profile_request(path: Path) -> ProfileRequest | None:
    """The request in ``path``; None when there is none. Malformed: an error naming it."""
    try:
        body = json.loads(path.read_text())
        ranks = body.get("ranks")
        return ProfileRequest(capture=int(body["capture"]), steps=int(body["steps"]),
                              ranks=tuple(int(r) for r in ranks) if ranks is not None
                              else None)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: not a profile request: {exc}") from None


def write_profile_request(path: Path, request: ProfileRequest) -> None:
    write_json_atomic(path, {"capture": request.capture, "steps": request.steps,
                             "ranks": list(request.ranks) if request.ranks is not None
                             else None})


@dataclass(frozen=True, slots=True)
class Control:
    seq: int
    setting: dict[str, Any] = field(default_factory=dict)  # precision, compression (optional)


def read_control(path: Path) -> Control | None:
    """The message in ``path``; None when there is none. A malformed file is an error naming
    it (the daemon writes it atomically, so a half-written file cannot occur)."""
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a control message: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("seq"), int) \
            or not isinstance(body.get("setting", {}), dict):
        raise ValueError(f"{path}: a control message is {{'seq': int, 'setting': {{...}}}}")
    return Control(seq=body["seq"], setting=body.get("setting", {}))


def write_control(path: Path, control: Control) -> None:
    """Replace ``path`` with ``control`` in one rename: a reader sees the old or the new."""
    write_json_atomic(path, {"seq": control.seq, "setting": control.setting})


def write_json_atomic(path: Path, body: Any) -> None:
    """Replace ``path`` with ``body`` as JSON in one rename: a reader sees the old or the new,
    never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(body).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing: a temporary file in the same folder (``.tmp-``
    in front, which readers of a folder skip), flushed to disk, then renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
