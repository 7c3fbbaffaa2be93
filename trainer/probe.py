"""A bounded all-reduce probe, run between steps: latency and bandwidth per message size.

It measures the fabric the job actually runs on (gloo over loopback here, NCCL over NVLink or
the network on GPU nodes), so a slow link shows up as a number, not a guess. It waits for each
collective (on CUDA it synchronises the stream): that is why it runs between steps, every
``telemetry.probe_every`` steps, never inside one.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from traind.trainer.device import device_synchronize


def all_reduce_probe(sizes: list[int], repeats: int, device: torch.device) -> list[float]:
    """Median seconds of one all-reduce of each size (bytes, fp32), after one warm-up each.
    Collective: every rank must call it at the same step with the same arguments."""
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up: connection set-up and allocation are not latency
        times = []
        for _ in range(repeats):
            device_synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            device_synchronize(device)  # NCCL's all-reduce returns before it is done
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
        del buf
    return out
