"""The daemon's refusals as FastAPI's 422 items, from their structured ``(loc, msg)`` pairs.

The service raises a ``ValueError``; a ``FieldErrors`` one (``traind.errors``: a config
error, a refused reorder) carries each problem with its field's path, which becomes the item's
``loc`` under ``"body"``, the shape FastAPI gives its own validation errors. Any other
``ValueError`` names no field and is reported against the body as a whole.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status

from traind.errors import FieldErrors


def field_errors(exc: ValueError) -> list[dict[str, Any]]:
    """One 422 item per problem: ``{"loc": ["body", *loc], "msg": msg, "type": "value_error"}``."""
    return [{"loc": ["body", *loc], "msg": msg or "invalid", "type": "value_error"}
            for loc, msg in FieldErrors.of(exc).errors]


def unprocessable(exc: ValueError) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=field_errors(exc))
