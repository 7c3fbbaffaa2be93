"""traind's optional parts: each lives behind a pip extra, is imported only where it is used,
and, when missing, is named in one line that says what to install (never a traceback).

pyproject's ``[project.optional-dependencies]`` is the home of the extras themselves; this table
only says which import belongs to which extra, and a test holds the two together.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType


@dataclass(frozen=True, slots=True)
class Extra:
    name: str     # the extra: pip install 'traind[<name>]'
    package: str  # the distribution it brings, as pip names it
    purpose: str  # what needs it, for the message


# top-level import name -> the extra that brings it
EXTRAS: dict[str, Extra] = {
    "grafana_client": Extra("grafana", "grafana-client", "pushing dashboards to Grafana"),
    "opentelemetry.exporter.otlp": Extra("otlp", "opentelemetry-exporter-otlp-proto-http",
                                         "exporting traces over OTLP/HTTP"),
    "psycopg": Extra("postgres", "psycopg", "a PostgreSQL database"),
    "triton": Extra("kernels", "triton", "the Triton kernels"),
    "torchao": Extra("fp8", "torchao", "fp8 training"),
    "pyarrow": Extra("parquet", "pyarrow", "reading Parquet files"),
    "transformers": Extra("hf", "transformers", "a Hugging Face model (model.hf)"),
}


class MissingExtra(ImportError):
    """An optional part is not installed; the message is the one line a user needs."""


def _extra_of(module: str) -> Extra:
    for prefix, extra in EXTRAS.items():
        if module == prefix or module.startswith(prefix + "."):
            return extra
    raise KeyError(f"{module!r} belongs to no traind extra")  # a programming error


def install_hint(module: str) -> str:
    """``pip install 'traind[x]'`` for the extra that brings ``module``."""
    extra = _extra_of(module)
    return f"pip install 'traind[{extra.name}]' (or {extra.package})"


def missing_message(module: str) -> str:
    extra = _extra_of(module)
    return f"{extra.purpose} needs {extra.package}, which is not installed: {install_hint(module)}"


def available(module: str) -> bool:
    """Whether ``module`` (of an extra) can be imported, without importing it."""
    _extra_of(module)
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def require(module: str) -> ModuleType:
    """Import ``module`` of an optional extra, or raise :class:`MissingExtra` naming the extra."""
    _extra_of(module)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only the extra's own absence is ours to explain; a broken install's own missing
        # dependency (some other name) is re-raised as it is.
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise
        raise MissingExtra(missing_message(module)) from None
