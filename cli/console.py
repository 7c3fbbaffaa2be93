"""How every ``traind`` command reports an error: one red ``error:`` line on stderr.

The message is escaped, not read as rich markup: an error naming ``traind[grafana]`` or a
field such as ``telemetry.probe_sizes[0]`` would otherwise lose its brackets. Soft wrapping
keeps it one line for whoever greps a log.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def print_error(message: object) -> None:
    stderr.print(f"[bold red]error:[/] {escape(str(message))}")


def fail(message: object, code: int = 1) -> typer.Exit:
    """Print the error; the caller raises what this returns (``raise fail(...) from None``)."""
    print_error(message)
    return typer.Exit(code)
