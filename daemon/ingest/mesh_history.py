"""One run's device mesh as the Communication page draws it: the ranks by (dp, tp, pp)
coordinate, what each mesh dimension moved and how long it took, and each pipeline stage's
bubble. Folded from every rank's events by :class:`~traind.daemon.ingest.comm_history.
CommHistory` (one :class:`MeshFold` per run); pure arithmetic, no clock.

Where the figures come from:

- the shape: the ``started`` lifecycle event's ``detail["mesh"]``; each rank's coordinate is
  the one its own started event reports (``parallel.placement = auto`` may lay ranks out in
  another order), else ``contracts.mesh.coordinates`` of its rank (the fixed layout, the
  trainer's own, not re-derived);
- dp and tp: comm events of that ``mesh_dim``: bytes the ranks handed their collectives and
  the time some collective was in flight (``allreduce_seconds``, the union of the intervals);
- pp: pipeline events, each one report step's: the activation bytes a stage sent (its
  ``p2p`` sends, forward and backward; every byte sent is received once, so sends alone
  count the traffic), the host time it blocked waiting on its sends and receives (a
  receive's wait holds the neighbour's compute too: trainer/pipeline_p2p.py), and the bubble
  measured beside the schedule's theory. An event without P2P times leaves pp's untimed.

Every figure is per rank and step: a dimension's sums over ranks and reports, divided by the
rank-steps they cover, so a dimension's line reads the same at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from traind.contracts.events import CommEvent, LifecycleEvent, PipelineEvent
from traind.contracts.mesh import MESH_DIMS, coordinates


@dataclass(slots=True)
class _Dim:
    rank_steps: int = 0  # the optimizer steps the reports covered, summed over ranks
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    timed: bool = True  # False: a report came without times (pp from an older trainer)


@dataclass(slots=True)
class MeshFold:
    """One run's mesh figures; :meth:`observe` every rank's events, :meth:`view` for a page
    (None unless the run has a mesh with tp or pp beyond 1)."""

    shape: dict[str, int] = field(default_factory=dict)
    dims: dict[str, _Dim] = field(default_factory=dict)
    stages: dict[int, PipelineEvent] = field(default_factory=dict)  # per rank: its latest
    placed: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> its coordinate

    def observe(self, event: Any) -> None:
        if isinstance(event, LifecycleEvent):
            if event.phase == "started" and isinstance(mesh := event.detail.get("mesh"), dict):
                self.shape = {d: int(mesh.get(d, 1)) for d in MESH_DIMS}
                if isinstance(at := event.detail.get("coordinates"), dict):
                    self.placed[event.rank] = {d: int(at.get(d, 0)) for d in MESH_DIMS}
        elif isinstance(event, CommEvent):
            d = self.dims.setdefault(event.mesh_dim, _Dim())
            d.rank_steps += max(event.steps, 1)
            d.bytes += sum(int(c["bytes"]) for c in event.collectives)
            d.calls += sum(int(c["calls"]) for c in event.collectives)
            d.seconds += event.allreduce_seconds
        elif isinstance(event, PipelineEvent):
            self.stages[event.rank] = event
            d = self.dims.setdefault("pp", _Dim())
            d.rank_steps += 1
            d.timed = d.timed and all("seconds" in p for p in event.p2p)
            d.seconds += sum(float(p.get("seconds", 0.0)) for p in event.p2p)
            sends = [p for p in event.p2p if p["op"] == "send"]
            d.bytes += sum(int(p["bytes"]) for p in sends)
            d.calls += sum(int(p["calls"]) for p in sends)

    def view(self) -> dict[str, Any] | None:
        shape = self.shape
        if not shape or (shape["tp"] == 1 and shape["pp"] == 1):
            return None
        world = shape["dp"] * shape["tp"] * shape["pp"]
        return {
            "shape": dict(shape),
            "ranks": [{"rank": r, **self.placed.get(r, coordinates(r, **shape))}
                      for r in range(world)],
            "dims": [self._dim(name, d) for name, d in sorted(
                self.dims.items(), key=lambda kv: MESH_DIMS.index(kv[0])
                if kv[0] in MESH_DIMS else len(MESH_DIMS))],
            "stages": self._stages(),
        }

    @staticmethod
    def _dim(name: str, d: _Dim) -> dict[str, Any]:
        n = max(d.rank_steps, 1)
        return {"mesh_dim": name, "bytes_per_step": d.bytes / n,
                "seconds_per_step": d.seconds / n if d.timed else None,
                "calls_per_step": d.calls / n}

    def _stages(self) -> list[dict[str, Any]]:
        """Per stage, over its ranks' latest reports: mean bubble, busy and idle; the
        activation bytes a rank sent per step, forward and backward."""
        by_stage: dict[int, list[PipelineEvent]] = {}
        for rank in sorted(self.stages):
            by_stage.setdefault(self.stages[rank].stage, []).append(self.stages[rank])
        out = []
        for stage, events in sorted(by_stage.items()):
            n = len(events)

            def sent(direction: str, evs: list[PipelineEvent] = events, k: int = n) -> float:
                return sum(p["bytes"] for e in evs for p in e.p2p
                           if p["op"] == "send" and p["direction"] == direction) / k

            out.append({
                "stage": stage, "ranks": [e.rank for e in events],
                "step": max(e.step for e in events),
                "bubble": sum(e.bubble for e in events) / n,
                "bubble_theory": events[0].bubble_theory,
                "busy_seconds": sum(e.busy_seconds for e in events) / n,
                "idle_seconds": sum(e.idle_seconds for e in events) / n,
                "sent_forward_bytes": sent("forward"), "sent_backward_bytes": sent("backward"),
            })
        return out
