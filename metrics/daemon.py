"""The daemon's metrics about itself: events in, events lost, live subscribers."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Info


class DaemonMetrics:
    def __init__(self, registry: CollectorRegistry, *, version: str, torch_version: str,
                 hub_dropped: Callable[[], float], subscribers: Callable[[], float]) -> None:
        Info("traind_build", "Versions of traind and torch.", registry=registry).info(
            {"version": version, "torch": torch_version})
        self.events = Counter("traind_events_received", "Events received from workers.",
                              ["kind"], registry=registry)
        self.malformed = Counter("traind_events_malformed", "Lines from workers that were not "
                                 "events.", registry=registry)
        self.runs = Counter("traind_runs_finished", "Runs that ended, by final state.",
                            ["state"], registry=registry)
        self.running = Gauge("traind_runs_running", "Runs whose workers are alive.",
                             registry=registry)
        Gauge("traind_live_messages_dropped", "Live messages dropped from slow browsers' "
              "queues (cumulative).", registry=registry).set_function(hub_dropped)
        Gauge("traind_live_subscribers", "Browsers connected to the live websocket.",
              registry=registry).set_function(subscribers)
