"""The process torchrun launches on each rank: read the config, train, report, exit.

    python -m torch.distributed.run --nproc_per_node N -m traind.trainer.worker \\
        --config CONFIG.json --events SOCKET_PATH

Exit status: 0 when training finished or was stopped gracefully (SIGTERM/SIGINT: the loop
writes a checkpoint and returns), 1 on any error, with its traceback on stderr for the daemon's
log. Only wiring here; the work is in :mod:`traind.trainer.loop`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from traind.contracts import failure
from traind.contracts.spool import ORPHAN_GRACE_SECONDS
from traind.trainer.config import TrainConfig
from traind.trainer.loop import train
from traind.trainer.sink import EventSink, FileSink, NullSink, SocketSink, Spool

if TYPE_CHECKING:
    from types import FrameType


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="traind.trainer.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="TrainConfig as JSON")
    parser.add_argument("--events", help="Unix socket of the daemon; events are discarded "
                        "when neither this nor --events-file is given")
    parser.add_argument("--events-file", type=Path, help="Append events as JSON lines to "
                        "this file plus '.rank<N>' (for tests and offline runs)")
    return parser.parse_args(argv)


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the loop sees it after the current step, checkpoints
    and returns, so a daemon (or torchrun forwarding its own SIGTERM) stops a run without
    losing work. A second signal does the same; the launcher's SIGKILL is the hard stop."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def watch_parent(stop: threading.Event, interval: float = 1.0,
                 grace: float = ORPHAN_GRACE_SECONDS) -> None:
    """Set ``stop`` when the launcher (torchrun) is gone and this rank has been reparented:
    nobody would otherwise end it, and it would train on as an orphan. A rank that has not
    left ``grace`` seconds later is stuck where ``stop`` is never read (a rendezvous or a
    collective waiting for a peer that is gone too): it exits there and then."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(interval):
            if os.getppid() != parent:
                stop.set()
                time.sleep(grace)
                sys.stderr.write(f"traind worker: launcher gone and still here after "
                                 f"{grace:.0f} s; exiting\n")
                sys.stderr.flush()
                os._exit(3)

    threading.Thread(target=watch, name="traind-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    install_stop_handlers(stop)
    watch_parent(stop)
    sink: EventSink = NullSink()
    try:
        cfg = TrainConfig.model_validate_json(args.config.read_text())
        if args.events:
            out_dir = cfg.job.out_dir
            sink = SocketSink(args.events, maxsize=cfg.telemetry.queue_size, spool=Spool(
                out_dir, int(os.environ.get("RANK", "0"))) if out_dir is not None else None)
        elif args.events_file:
            rank = os.environ.get("RANK", "0")
            sink = FileSink(args.events_file.with_name(f"{args.events_file.name}.rank{rank}"))
        train(cfg, sink, stop=stop)
    except BaseException as exc:
        traceback.print_exc(file=sys.stderr)
        # Last, in one line: the launcher's own traceback that follows names no error.
        sys.stderr.write(failure.line(int(os.environ.get("RANK", "0")), exc) + "\n")
        return 1
    finally:
        sink.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Out without the interpreter's shutdown: after a run that ended (events sent, sink and
    # checkpoint closed) it only tears down the collective backend's C++ threads, which once
    # hung a finished 2-rank gloo job in CI; torchrun would then wait for it forever.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
