"""The daemon's start-up: it records torch's version and never computes with torch, and it
computes no statistics until an experiment reports; so neither torch (1.2 s of imports
here) nor scipy.stats (0.8 s) is imported by ``traind serve`` or a CLI command. Measured:
``import traind.daemon.node`` took 3.5-3.9 s and takes 1.0 s."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.conftest import REPO
from traind.daemon.provenance import torch_build

HEAVY = ("torch", "scipy.stats", "torchao")


def test_the_daemon_and_the_cli_import_no_torch_and_no_scipy_stats() -> None:
    code = ("import json, sys, traind.daemon.node, traind.cli.main\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_torch_build_is_read_without_importing_it() -> None:
    assert torch_build().version == torch.__version__
    assert torch_build().cuda == torch.version.cuda
