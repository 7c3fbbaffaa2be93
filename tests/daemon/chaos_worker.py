"""A queue worker for the chaos test (run as a process): claim, work, heartbeat, complete.

When its heartbeat says the trial is no longer its own (it was frozen past its lease and the
trial was claimed again) it stops working, as the daemon's runner does, but still tries to
complete it: the worst case, so the test sees the queue refuse the outdated attempt. Every
step goes to a JSON-lines ledger.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from traind.daemon import queue
from traind.daemon.db.engine import make_engine

LEASE = 1.0


def main(url: str, ledger: str) -> None:
    engine = make_engine(url)
    owner = f"w{os.getpid()}"
    rng = random.Random(os.getpid())

    def log(**kw: object) -> None:
        with open(ledger, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "t": time.time(), **kw}) + "\n")

    while True:
        # Many attempts: the test kills at random, and the queue's rule that fails a trial
        # whose worker died 3 times (tests/daemon/test_queue.py) is not what it checks.
        trial = queue.claim(engine, owner=owner, lease_seconds=LEASE, max_attempts=100)
        if trial is None:
            depth = queue.queue_depth(engine)
            if depth["waiting"] == 0 and depth["running"] == 0:
                return
            time.sleep(0.05)
            continue
        log(event="start", trial=trial.trial_id, attempt=trial.attempt)
        mine = True
        end = time.monotonic() + rng.uniform(0.2, 0.5)
        while mine and time.monotonic() < end:
            time.sleep(0.05)
            mine = queue.heartbeat(engine, trial_id=trial.trial_id, attempt=trial.attempt,
                                   owner=owner, lease_seconds=LEASE)
            if mine:  # the last moment this attempt provably held the trial
                log(event="beat", trial=trial.trial_id, attempt=trial.attempt)
        ok = queue.complete(engine, trial_id=trial.trial_id, attempt=trial.attempt,
                            result={"owner": owner, "attempt": trial.attempt})
        log(event="end", trial=trial.trial_id, attempt=trial.attempt, accepted=ok,
            still_mine=mine)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
