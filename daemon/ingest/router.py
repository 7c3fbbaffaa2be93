"""The one way worker events enter the daemon: ``route(run_id, event)``.

Each ``Job`` hands its decoded events to ``Router.route`` on the event loop; the router calls
the observers the node registered, in registration order (the summary folds an event before the
hub reads its figures from it). Some observers want every rank (metrics, the summary, the
tracer, the promotions' guard: they filter ranks themselves), the rest only the run's lead rank
on this node (the live page, the database, a run's handles). Nothing here blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traind.contracts.events import SNREvent
from traind.daemon.ingest import messages

if TYPE_CHECKING:
    from collections.abc import Callable

    from traind.contracts.events import Event
    from traind.daemon.ingest.event_buffer import EventBuffer
    from traind.daemon.ingest.hub import EventHub



class Router:
    def __init__(self, lead: Callable[[int, int], bool]) -> None:
        """``lead(run_id, rank)``: whether ``rank`` speaks for its run on this node."""
        self._lead = lead
        self._observers: list[tuple[Callable[[int, Event], None], bool]] = []

    def add(self, observer: Callable[[int, Event], None], *, lead_only: bool = False) -> None:
        self._observers.append((observer, lead_only))

    def route(self, run_id: int, event: Event) -> None:
        lead = self._lead(run_id, event.rank)
        for observer, lead_only in self._observers:
            if lead or not lead_only:
                observer(run_id, event)


class HubFeed:
    """Lead-rank events to the live hub. Every SNR report repeats its window's figures until
    the next window: the page needs each window once."""

    def __init__(self, hub: EventHub, tokens_per_second: Callable[[int], float],
                 goodput: Callable[[int], dict[str, Any] | None] = lambda _run: None) -> None:
        """``tokens_per_second`` and ``goodput``: a run's figures as its summary holds them."""
        self.hub, self._tps, self._goodput = hub, tokens_per_second, goodput
        self._snr_windows: dict[int, int] = {}  # run -> the last SNR window sent

    def __call__(self, run_id: int, event: Event) -> None:
        if isinstance(event, SNREvent):
            if self._snr_windows.get(run_id) == event.window_step:
                return
            self._snr_windows[run_id] = event.window_step
        msg = messages.hub_message(run_id, event, tokens_per_second=self._tps(run_id),
                                   goodput=self._goodput(run_id))
        if msg is not None:
            self.hub.publish(msg)

    def forget(self, run_id: int) -> None:
        """The run ended: its SNR window is not needed any more."""
        self._snr_windows.pop(run_id, None)


def store_feed(buffer: EventBuffer) -> Callable[[int, Event], None]:
    """Lead-rank events the database keeps, into the buffer the flush writes from."""
    def store(run_id: int, event: Event) -> None:
        if (r := messages.row(event)) is not None:
            buffer.add(run_id, r)
    return store
