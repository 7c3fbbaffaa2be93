"""JSON for a page's series, written a piece at a time.

A whole run's series holds numpy arrays (daemon/runs/series_fold.py); turning them all into
Python lists first would cost more memory than folding the run did, and so would one string of
the whole body (13.5 MB at 20,000 points, two ranks and their communication). Each array is
written as a list (NaN and infinities as null, which JSON has instead) and sent on; the rest as
``json.dumps`` would, with the same null for a float that is not finite.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator


PIECE = 64 << 10  # bytes a streamed piece gathers before it is sent


def json_bytes(value: Any) -> bytes:
    return b"".join(json_pieces(value))


def json_pieces(value: Any) -> Iterator[bytes]:
    """``value`` as JSON, in pieces of about :data:`PIECE` bytes (an array's may be more)."""
    parts: list[str] = []
    size = 0
    for part in _parts(value):
        parts.append(part)
        size += len(part)
        if size >= PIECE:
            yield "".join(parts).encode()
            parts, size = [], 0
    if parts:
        yield "".join(parts).encode()


def _parts(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + json.dumps(str(key)) + ":"
            yield from _parts(item)
        yield "}"
    elif isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            yield json.dumps([v if math.isfinite(v) else None for v in value.tolist()])
        else:
            yield json.dumps(value.tolist())
    elif isinstance(value, list | tuple):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _parts(item)
        yield "]"
    elif isinstance(value, float | np.floating):
        yield json.dumps(float(value)) if math.isfinite(value) else "null"
    elif isinstance(value, np.integer | np.bool_):
        yield json.dumps(value.item())
    else:
        yield json.dumps(value, default=str)
