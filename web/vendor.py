"""Third-party browser assets served straight from installed Python packages.

plotly.js ships inside the ``plotly`` wheel (``plotly/package_data/plotly.min.js``); serving it
from site-packages means no copied 4.8 MB file in the repository, no CDN (nodes are often
offline) and no node build. The package version goes into the URL so the long cache header is
safe across upgrades.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
from functools import cache
from pathlib import Path


@cache
def plotly_js_path() -> Path:
    """The ``plotly.min.js`` file inside the installed ``plotly`` package."""
    resource = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    # The wheel is installed as plain files, so the resource is a real path on disk.
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"plotly.min.js not found in the plotly package at {path}")
    return path


@cache
def plotly_version() -> str:
    return importlib.metadata.version("plotly")
