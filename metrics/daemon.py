"""The daemon's metrics about itself: events in, events lost, live subscribers, scrapes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from traind.metrics.catalog import counter, gauge, info

if TYPE_CHECKING:
    from collections.abc import Callable

    from prometheus_client import CollectorRegistry

    from traind.metrics.goodput import NodeGoodput


class DaemonMetrics:
    def __init__(self, registry: CollectorRegistry, *, version: str, torch_version: str,
                 hub_dropped: Callable[[], float], subscribers: Callable[[], float],
                 db_pending: Callable[[], float],
                 node_goodput: NodeGoodput | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``node_goodput``: the node's goodput since the start, read at each scrape."""
        info(registry, "traind_build").info({"version": version, "torch": torch_version})
        self.events = counter(registry, "traind_events_received")
        self.malformed = counter(registry, "traind_events_malformed")
        self.runs = counter(registry, "traind_runs_finished")
        self.running = gauge(registry, "traind_runs_running")
        self.scrape_seconds = gauge(registry, "traind_scrape_duration_seconds")
        self.scrape_series = gauge(registry, "traind_scrape_series")
        gauge(registry, "traind_live_messages_dropped").set_function(hub_dropped)
        gauge(registry, "traind_live_subscribers").set_function(subscribers)
        gauge(registry, "traind_db_pending_events").set_function(db_pending)
        if node_goodput is not None:
            node = node_goodput
            gauge(registry, "traind_node_goodput_ratio").set_function(
                lambda: node.ratio(clock()))
            gauge(registry, "traind_node_productive_seconds").set_function(node.productive)
            gauge(registry, "traind_node_idle_seconds").set_function(lambda: node.idle(clock()))
