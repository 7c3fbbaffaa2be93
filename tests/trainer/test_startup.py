"""A job's start-up: what a worker imports before its first step.

Every job pays its worker's imports, and so does every test that starts one. torch._dynamo
(1.3 s here, brought by torch.distributed.pipelining and torch.compiler's decorators) and
torch.distributed.tensor (0.4 s, by DCP's state dicts and tensor parallel) are imported only
by the jobs that use them: compile, pp, tp, sharded checkpoints.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.pipelining",
         "torch.distributed.checkpoint")


def test_a_worker_imports_no_compiler_and_no_dtensor() -> None:
    code = ("import json, sys, traind.trainer.worker\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_is_dtensor_without_importing_dtensor() -> None:
    code = ("import sys, torch\n"
            "from traind.kernels._dispatch import is_dtensor\n"
            "assert not is_dtensor(torch.ones(2))\n"
            "assert 'torch.distributed.tensor' not in sys.modules\n"
            "import torch.distributed as dist\n"
            "from torch.distributed.tensor import DTensor, DeviceMesh, Replicate\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0,"
            " world_size=1)\n"
            "t = DTensor.from_local(torch.ones(2), DeviceMesh('cpu', [0]), [Replicate()])\n"
            "assert is_dtensor(t) and not is_dtensor(t.to_local())\n"
            "dist.destroy_process_group()\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                   timeout=120, check=True)
