"""A JSON column's value at a path equal to a typed-in value, the same on SQLite and PostgreSQL.

SQLAlchemy's JSON path operators (``column[("a", "b")]`` with ``as_string()``, ``as_float()``,
``as_boolean()``) extract portably, but the two databases disagree on what comes out:
SQLite's ``json_extract`` keeps the JSON type (2 stays an integer, so it never equals the
text '2'), PostgreSQL's ``#>>`` gives text (so it does), and PostgreSQL's cast of a text to a
number fails the whole query on the first run whose value is a string. So each comparison is
guarded by the value's JSON type, read with the one function each database has for it, and a
cast happens only inside a ``CASE`` that found the right type. The path is a bound parameter.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import String, and_, case, false, or_
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

if TYPE_CHECKING:
    from sqlalchemy.sql.compiler import SQLCompiler
    from sqlalchemy.sql.elements import BinaryExpression, ColumnElement

# json_type (SQLite) and json_typeof (PostgreSQL) name the types differently.
_STRING = ("text", "string")
_NUMBER = ("integer", "real", "number")
_BOOLEAN = ("true", "false", "boolean")


class json_kind(FunctionElement[str]):
    """The JSON type of ``column[path]``'s value (NULL where the path is missing)."""

    type = String()
    inherit_cache = True
    name = "json_kind"


@compiles(json_kind, "sqlite")
def _sqlite_kind(element: json_kind, compiler: SQLCompiler, **kw: Any) -> str:
    # json_type(column, path): the path bound with SQLite's own JSON path type.
    item = cast("BinaryExpression[Any]", next(iter(element.clauses)))
    return f"json_type({compiler.process(item.left, **kw)}, {compiler.process(item.right, **kw)})"


@compiles(json_kind, "postgresql")
def _postgres_kind(element: json_kind, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_typeof({compiler.process(next(iter(element.clauses)), **kw)})"


def json_equals(item: Any, typed: str) -> ColumnElement[bool]:
    """Whether ``item`` (a JSON column indexed by a path tuple) holds ``typed``: as a string,
    and where it reads as JSON, as that number, boolean or null too."""
    kind = json_kind(item)
    matches = [and_(kind.in_(_STRING), item.as_string() == typed)]
    try:
        parsed = json.loads(typed)
    except ValueError:
        parsed = typed  # only a string
    if parsed is None:
        matches.append(kind == "null")
    elif isinstance(parsed, bool):
        matches.append(case((kind.in_(_BOOLEAN), item.as_boolean())) == parsed)
    elif isinstance(parsed, int | float) and math.isfinite(parsed):
        matches.append(case((kind.in_(_NUMBER), item.as_float())) == float(parsed))
    return or_(false(), *matches)
