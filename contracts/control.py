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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".control.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"seq": control.seq, "setting": control.setting}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
