"""Two nodes on one machine: a 2-node DDP job over a shaped link, per compression method.

    sudo python bench/multinode.py                       # 0.1, 1 and 10 Gbit/s links
    sudo python bench/multinode.py --rates 100mbit --methods none,int8 --steps 20
    sudo python bench/multinode.py --json out.json       # also the rows as JSON (the test)

Two network namespaces joined by a veth pair stand for two nodes, each with its own address;
``tc``'s token bucket (tbf) shapes both directions of the link to the given rate. In each
namespace torchrun starts one rank (``--nnodes 2``); the c10d rendezvous on the first node's
address joins them, and gloo carries the gradients over the veth (GLOO_SOCKET_IFNAME). For
each rate the methods run in turn (rotated between repeats, so drift does not favour one) and
the table shows the median step time after warm-up, the time in collectives, the bytes each
rank sent per step, and the final loss of both ranks. Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from netns import SUBNET, shape, two_nodes  # bench/netns.py (this script's folder)

from traind.contracts.events import CommEvent, StepEvent, decode_complete

PORT = 29455


def job_config(out: Path, method: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    return {
        "job": {"name": f"mn-{method}", "steps": args.steps, "batch_size": 2,
                "nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"{SUBNET}.1:{port}",
                "eval_every": 10**6, "checkpoint_every": 10**6, "threads": 1,
                "out_dir": str(out), "resume": False},
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
                  "seq_len": 64},
        "data": {"max_bytes": 2_000_000},
        "compression": {"method": method, "powersgd_rank": 4},
        "telemetry": {"every": 1},
    }


def run_job(nodes: tuple[str, str, str, str], method: str, args: argparse.Namespace,
            tmp: Path, port: int) -> dict[str, Any]:
    ns_a, ns_b, dev_a, dev_b = nodes
    out = tmp / f"{method}-{port}"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(job_config(out / "run", method, args, port)))
    procs = []
    for ns, dev, node in ((ns_a, dev_a, "a"), (ns_b, dev_b, "b")):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        # Node a hosts the rendezvous store: say so, because torchrun guesses it from the
        # machine's host name, which inside a namespace resolves to the other network...
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint={SUBNET}.1:{port}", f"--rdzv_id=mn-{port}",
               f"--rdzv_conf=is_host={'true' if node == 'a' else 'false'}",
               # ...and its own address for the ranks' store (the host name would not do)
               f"--local_addr={SUBNET}.{1 if node == 'a' else 2}",
               "-m", "traind.trainer.worker", "--config", str(out / "config.json"),
               "--events-file", str(out / f"events.{node}")]
        with open(out / f"log.{node}", "wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tail = "\n".join((out / f"log.{n}").read_text()[-1500:] for n in "ab")
            raise RuntimeError(f"{method}: no end in {args.timeout} s:\n{tail}") from None
    if any(p.returncode != 0 for p in procs):
        tail = (out / "log.a").read_text()[-2000:]
        raise RuntimeError(f"{method}: exit codes {[p.returncode for p in procs]}\n{tail}")
    return summarize(out, method, args.warmup)


def summarize(out: Path, method: str, warmup: int) -> dict[str, Any]:
    ranks = sorted(out.glob("events.*.rank*")) or sorted(out.glob("events.*"))
    per_rank = [decode_complete(p.read_bytes()) for p in ranks]
    steps = [e for e in per_rank[0] if isinstance(e, StepEvent) and e.step > warmup]
    comm = [e for e in per_rank[0] if isinstance(e, CommEvent) and e.step > warmup and e.steps]
    finals = [max((e for e in evs if isinstance(e, StepEvent)), key=lambda e: e.step)
              for evs in per_rank]
    return {
        "method": method,
        "step_ms": 1000 * statistics.median(e.step_seconds for e in steps),
        "comm_ms": 1000 * sum(c.allreduce_seconds for c in comm) / max(1, sum(c.steps
                                                                             for c in comm)),
        "hook_ms": 1000 * sum(c.hook_seconds for c in comm) / max(1, sum(c.steps for c in comm)),
        "sent_mb": sum(c.sent_bytes for c in comm) / max(1, sum(c.steps for c in comm)) / 1e6,
        "final_step": [f.step for f in finals],
        "final_loss": [round(f.loss, 4) for f in finals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit")
    parser.add_argument("--methods", default="none,int8,powersgd")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: network namespaces and tc")
    methods = args.methods.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="traind-mn-") as tmp, \
            two_nodes(str(os.getpid() % 10000)) as nodes:
        port = PORT
        for rate in args.rates.split(","):
            shape(nodes[0], nodes[2], rate)
            shape(nodes[1], nodes[3], rate)
            for r in range(args.repeats):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                for method in order:
                    port += 1
                    row = {"rate": rate, "repeat": r,
                           **run_job(nodes, method, args, Path(tmp), port)}
                    rows.append(row)
                    print(f"  {rate:>8} {method:<9} step {row['step_ms']:7.1f} ms  "
                          f"collectives {row['comm_ms']:7.1f} ms  hook {row['hook_ms']:6.1f} "
                          f"ms  sent {row['sent_mb']:6.2f} MB/step  loss {row['final_loss']}",
                          flush=True)
    print("\n| link | method | step time (median, ms) | in collectives (ms/step) | "
          "compressing (ms/step) | sent per rank (MB/step) | speed vs none |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate in args.rates.split(","):
        mine = [r for r in rows if r["rate"] == rate]
        base = statistics.median(r["step_ms"] for r in mine if r["method"] == "none") \
            if any(r["method"] == "none" for r in mine) else None
        for method in methods:
            ms = [r for r in mine if r["method"] == method]
            step = statistics.median(r["step_ms"] for r in ms)
            comm = statistics.median(r["comm_ms"] for r in ms)
            sent = statistics.median(r["sent_mb"] for r in ms)
            hook = statistics.median(r["hook_ms"] for r in ms)
            speed = f"{base / step:.2f}x" if base else "-"
            print(f"| {rate} | {method} | {step:.1f} | {comm:.1f} | {hook:.1f} | {sent:.2f} "
                  f"| {speed} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
