"""traind: an observability-first training daemon.

The repository root is this package (see pyproject's package-dir), so the folders are
``traind.daemon``, ``traind.cli``, ``traind.trainer``, ``traind.metrics``, ``traind.web`` and
``traind.kernels``.
"""

__version__ = "0.1.0"
