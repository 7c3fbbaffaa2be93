"""What both sides of the worker boundary share: the events a rank sends, the control messages
the daemon hands a running job, and the bounds that bin communication figures.

Plain dataclasses and the standard library only (no torch, nothing else of traind's), so the
trainer, the metrics and the daemon all import it and none of them imports another's internals.
"""
