"""The states a run, an experiment, a trial, an auto-tune search and a promotion go through:
one list each, which the database's queries, the runners, the Prometheus collector and the
pages all read (a page shows "unknown" for anything else, so a state missing here is seen)."""

from __future__ import annotations

RUN_STATES = ("queued", "running", "completed", "failed", "stopped", "preempted")

EXPERIMENT_ACTIVE = ("queued", "running")
EXPERIMENT_ENDED = ("done", "cancelled", "failed")
EXPERIMENT_STATES = EXPERIMENT_ACTIVE + EXPERIMENT_ENDED

TRIAL_ENDED = ("done", "failed", "cancelled")
TRIAL_STATES = ("waiting", "running", *TRIAL_ENDED)

AUTOTUNE_STATES = ("running", "done", "failed", "cancelled")
# unchanged: nothing was sent (nothing beat the baseline, or the run already had the
# setting); refused: the job refused the message, or the promote path refused the evidence
PROMOTION_STATES = ("pending", "applied", "kept", "rolling_back", "rolled_back", "refused",
                    "superseded", "unchanged")
