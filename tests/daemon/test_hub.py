import asyncio

from traind.daemon.ingest.hub import EventHub


def _step(run: int, step: int) -> dict:
    return {"type": "step", "run": run, "step": step, "loss": 1.0}


def test_snapshot_is_the_newest_run_bounded():
    hub = EventHub(capacity=3)
    for s in range(5):
        hub.publish(_step(1, s))
    hub.publish(_step(2, 0))
    hub.publish({"type": "eval", "run": 2, "step": 0, "val_loss": 2.0})
    snap = hub.snapshot()
    assert snap["run"] == 2 and len(snap["steps"]) == 1 and len(snap["evals"]) == 1
    hub2 = EventHub(capacity=3)
    for s in range(5):
        hub2.publish(_step(1, s))
    assert [m["step"] for m in hub2.snapshot()["steps"]] == [2, 3, 4]


def test_slow_subscriber_drops_oldest_and_counts():
    async def main() -> tuple[list[int], int, int]:
        hub = EventHub(subscriber_queue=2)
        async with hub.subscribe() as messages:
            for s in range(5):
                hub.publish(_step(1, s))
            got = [(await anext(messages))["step"] for _ in range(2)]
            subs = hub.subscribers
        return got, hub.dropped, subs - hub.subscribers

    got, dropped, left = asyncio.run(main())
    assert got == [3, 4]
    assert dropped == 3
    assert left == 1  # leaving the context unsubscribes


def test_snapshot_keeps_the_newest_runs_precision_switches_and_snr_windows():
    hub = EventHub()
    hub.publish(_step(4, 16))
    switch = {"type": "precision", "run": 4, "step": 16, "group": "block.0", "before": "fp32",
              "after": "bf16", "snr": 9.0}
    window = {"type": "snr", "run": 4, "step": 16, "groups": ["block.0"], "snr": [9.0],
              "modes": ["bf16"]}
    hub.publish(switch)
    hub.publish(window)
    hub.publish({**switch, "run": 3})  # an older run's: not in the newest run's snapshot
    snap = hub.snapshot()
    assert snap["run"] == 4
    assert snap["precision"] == [switch] and snap["snr"] == [window]
    assert EventHub().snapshot() == {"type": "snapshot", "run": None, "steps": [], "evals": [],
                                     "precision": [], "snr": []}


def test_snapshot_of_a_chosen_run():
    hub = EventHub(capacity=10)
    for run, step in ((1, 1), (2, 1), (1, 2)):
        hub.publish({"type": "step", "run": run, "step": step})
    assert [m["step"] for m in hub.snapshot(1)["steps"]] == [1, 2]
    assert hub.snapshot()["run"] == 2  # none chosen: the newest
    # a run with nothing buffered (yet, or any more): its own empty snapshot, not another's
    assert hub.snapshot(7) == {"type": "snapshot", "run": 7, "steps": [], "evals": [],
                               "precision": [], "snr": []}
