"""JSON for a page's series, written off the event loop, one array at a time.

A whole run's series holds numpy arrays (daemon/runs/series_fold.py); turning them all into
Python lists first would cost more memory than folding the run did. Each array is written as
a list (NaN and infinities as null, which JSON has instead) and dropped; the rest as
``json.dumps`` would, with the same null for a float that is not finite.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def json_bytes(value: Any) -> bytes:
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts).encode()


def _write(value: Any, out: list[str]) -> None:
    if isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + json.dumps(str(key)) + ":")
            _write(item, out)
        out.append("}")
    elif isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            items = [v if math.isfinite(v) else None for v in value.tolist()]
        else:
            items = value.tolist()
        out.append(json.dumps(items))
    elif isinstance(value, list | tuple):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    elif isinstance(value, float | np.floating):
        out.append(json.dumps(float(value)) if math.isfinite(value) else "null")
    elif isinstance(value, np.integer | np.bool_):
        out.append(json.dumps(value.item()))
    else:
        out.append(json.dumps(value, default=str))
