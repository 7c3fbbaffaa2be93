"""Runs: the supervisor that launches and watches jobs, the job runner, summaries, checkpoints."""
