"""Worker events into the daemon: the one router, the live hub, the database buffer."""
