"""Errors that name fields: each problem travels as a ``(loc, msg)`` pair, never as text that
a reader has to parse back.

``loc`` is the field's path as pydantic gives it: a tuple of field names and list indexes,
``("interleave", "arms", 1, "compression", "method")``; ``()`` is the config (or the request)
as a whole. A tuple rather than a dotted string, because a part may hold a dot itself: an
auto-tune candidate ``"fp32.int8"`` is one part. ``msg`` is the reason, as a person reads it.

The config loader (``daemon/config.py``) builds the pairs from pydantic's
``ValidationError.errors()``; the trainer's and the daemon's own checks build them directly.
The API returns each as a 422 item (``["body", *loc]``), a form shows it beside the input its
path belongs to, and the CLI prints ``path: msg`` lines. This module imports nothing of traind,
so the trainer, the daemon and the web layer all raise or read the same type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Self

Loc = tuple[str | int, ...]
FieldError = tuple[Loc, str]  # (loc, msg)


def dotted(loc: Loc) -> str:
    """The path as a person types it: ``interleave.arms.1.compression``."""
    return ".".join(str(p) for p in loc)


def line(loc: Loc, msg: str) -> str:
    """``path: msg``; a problem about no one field is its message alone."""
    return f"{dotted(loc)}: {msg}" if loc else msg


class FieldErrors(ValueError):
    """One or more problems, each with its field's path (``errors``: ``(loc, msg)`` pairs).

    ``str()`` is what a person reads: a ``path: msg`` line per problem, or ``text`` where the
    raiser words the same problems otherwise (a heading over indented lines, say). A plain
    string is one problem about no one field.
    """

    def __init__(self, errors: Iterable[FieldError] | str, text: str | None = None) -> None:
        pairs = [((), errors)] if isinstance(errors, str) else errors
        self.errors: tuple[FieldError, ...] = tuple((tuple(loc), str(msg)) for loc, msg in pairs)
        super().__init__("\n".join(line(*e) for e in self.errors) if text is None else text)

    @classmethod
    def at(cls, loc: Loc, msg: str) -> Self:
        """One problem with the field at ``loc``."""
        return cls([(loc, msg)])

    @classmethod
    def of(cls, exc: ValueError) -> Self:
        """``exc`` as field errors of this class, its text kept: its own pairs when it names
        fields, else one problem about no one field."""
        if isinstance(exc, cls):
            return exc
        pairs = exc.errors if isinstance(exc, FieldErrors) else [((), str(exc))]
        return cls(pairs, str(exc))

    def within(self, part: str | int) -> Self:
        """These problems as they belong to ``part`` (an auto-tune candidate, say): one more
        part in front of each path, and the text reads ``part: <text>``."""
        return type(self)([((part, *loc), msg) for loc, msg in self.errors], f"{part}: {self}")
