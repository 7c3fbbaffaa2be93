"""The node's experiment slots: a bounded pool whose freed slot goes to the oldest waiter."""

from __future__ import annotations

import asyncio

import pytest

from traind.daemon.experiments.slots import Slots
from traind.daemon.service import ShuttingDown


def test_a_freed_slot_goes_to_the_oldest_experiment_not_the_first_to_ask() -> None:
    async def main() -> list[int]:
        slots, order = Slots(1), []
        assert slots.try_acquire() and not slots.try_acquire()

        async def job(key: int) -> None:
            async with slots.hold(key):
                order.append(key)
                await asyncio.sleep(0)

        waiters = [asyncio.create_task(job(k)) for k in (7, 3, 5)]
        await asyncio.sleep(0)  # all three wait
        assert slots.busy == 1 and order == []
        slots.release()
        await asyncio.gather(*waiters)
        assert slots.busy == 0
        return order

    assert asyncio.run(main()) == [3, 5, 7]


def test_the_size_is_how_many_run_at_once() -> None:
    async def main() -> int:
        slots, running, most = Slots(2), 0, 0

        async def job(key: int) -> None:
            nonlocal running, most
            async with slots.hold(key):
                running += 1
                most = max(most, running)
                await asyncio.sleep(0.001)
                running -= 1

        await asyncio.gather(*(job(k) for k in range(6)))
        return most

    assert asyncio.run(main()) == 2


def test_a_cancelled_waiter_loses_its_place_and_no_slot_is_lost() -> None:
    async def main() -> None:
        slots = Slots(1)
        assert slots.try_acquire()
        gone = asyncio.create_task(slots.acquire(1))
        later = asyncio.create_task(slots.acquire(2))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        slots.release()  # skips the cancelled waiter
        await asyncio.wait_for(later, 1)
        # Cancelled in the moment the slot was handed over: it is passed on, not lost.
        handed = asyncio.create_task(slots.acquire(3))
        await asyncio.sleep(0)
        slots.release()
        handed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handed
        assert slots.busy == 0 and slots.try_acquire()

    asyncio.run(main())


def test_closing_wakes_every_waiter_with_shutting_down() -> None:
    async def main() -> None:
        slots = Slots(1)
        assert slots.try_acquire()
        waiter = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        slots.close()
        with pytest.raises(ShuttingDown):
            await waiter
        with pytest.raises(ShuttingDown):
            await slots.acquire(2)
        slots.release()  # the holder still gives its slot back

    asyncio.run(main())
    with pytest.raises(ValueError, match="size"):
        Slots(0)
    with pytest.raises(RuntimeError, match="never taken"):
        Slots(1).release()


def test_the_cluster_runner_claims_a_node_slot_only_while_it_holds_the_nodes_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster job's ranks would share the cores with an experiment job: the node claims a
    cluster slot only once no experiment job runs, and holds the node's slot while it trains."""
    from traind.daemon.experiments import cluster

    async def main() -> None:
        slots = Slots(1)
        busy_at_claim: list[int] = []
        claims = iter([None, object()])  # nothing queued at first, then a node slot
        trained, finish = asyncio.Event(), asyncio.Event()

        def claim(*_a: object, **_k: object) -> object:
            busy_at_claim.append(slots.busy)
            return next(claims, None)

        async def run(_self: object, _claimed: object) -> None:
            assert slots.busy == 1 and not slots.try_acquire()  # an experiment would wait
            trained.set()
            await finish.wait()

        monkeypatch.setattr(cluster.queue, "claim", claim)
        monkeypatch.setattr(cluster.SlotRunner, "_run", run)
        monkeypatch.setattr(cluster, "POLL_SECONDS", 0.01)
        assert slots.try_acquire()  # an experiment's job trains
        runner = cluster.SlotRunner(engine=None, settings=None, runs=None,  # type: ignore[arg-type]
                                    slots=slots)
        runner.start()
        await asyncio.sleep(0.05)
        assert busy_at_claim == []  # no claim while the node is busy
        slots.release()  # the experiment's job ends
        await asyncio.wait_for(trained.wait(), 5)
        assert busy_at_claim == [1, 1]  # each claim made holding the slot
        finish.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if slots.try_acquire():  # the cluster job ended: the slot is the node's again
                break
        else:
            raise AssertionError("the cluster slot's job ended but the node's slot was kept")
        await runner.close()

    asyncio.run(main())
