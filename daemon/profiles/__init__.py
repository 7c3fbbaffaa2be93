"""Profiles on demand: the daemon asks a running job for traces and reports on them."""
