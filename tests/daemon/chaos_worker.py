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

from traind.daemon.db import queue
from traind.daemon.db.engine import make_engine

LEASE = 1.0


def main(url: str, ledger: str) -> None:
    engine = make_engine(url)
    owner = f"w{os.getpid()}"
    rng = random.Random(os.getpid())

    def log(t: float | None = None, **kw: object) -> None:
        with open(ledger, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "t": time.time() if t is None else t,
                                **kw}) + "\n")

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
            # The time before the call: a worker frozen between a successful call and its
            # log line would otherwise log the proof late (the lease held at the call).
            asked = time.time()
            mine = queue.heartbeat(engine, trial_id=trial.trial_id, attempt=trial.attempt,
                                   owner=owner, lease_seconds=LEASE)
            if mine:  # a moment this attempt provably held the trial
                log(asked, event="beat", trial=trial.trial_id, attempt=trial.attempt)
        asked = time.time()
        ok = queue.complete(engine, trial_id=trial.trial_id, attempt=trial.attempt,
                            result={"owner": owner, "attempt": trial.attempt})
        log(asked, event="end", trial=trial.trial_id, attempt=trial.attempt, accepted=ok,
            still_mine=mine)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
