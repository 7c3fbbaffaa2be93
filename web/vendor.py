"""Third-party browser assets served straight from installed Python packages.

Swagger UI and ReDoc (for /api/docs and /api/redoc) ship inside ``fastapi-offline`` the same
way: an air-gapped node shows its API documentation too.

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


# What /api/docs (Swagger UI 5) and /api/redoc (ReDoc 2) load. swagger-ui-bundle, the obvious
# package, ships Swagger UI 4, which cannot read the OpenAPI 3.1 document FastAPI writes.
DOCS_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js")


@cache
def docs_file(name: str) -> Path:
    """One of :data:`DOCS_FILES` inside the installed ``fastapi_offline`` package."""
    if name not in DOCS_FILES:
        raise ValueError(f"not an API documentation file traind serves: {name!r}")
    path = Path(str(importlib.resources.files("fastapi_offline") / "static" / name))
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in the fastapi_offline package at {path}")
    return path


@cache
def docs_version() -> str:
    return importlib.metadata.version("fastapi-offline")
