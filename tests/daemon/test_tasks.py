"""KeyedTasks: one task per key, forgotten when it ends, all cancelled at close."""

from __future__ import annotations

import asyncio

from traind.daemon.tasks import KeyedTasks


def test_one_task_per_key_forgotten_when_it_ends() -> None:
    asyncio.run(_one_task_per_key_forgotten_when_it_ends())


async def _one_task_per_key_forgotten_when_it_ends() -> None:
    tasks: KeyedTasks[int] = KeyedTasks("t")
    release = asyncio.Event()
    ran: list[int] = []
    done: list[int] = []

    async def work(key: int) -> None:
        ran.append(key)
        await release.wait()

    assert tasks.start(1, lambda: work(1), on_done=lambda: done.append(1))
    assert not tasks.start(1, lambda: work(1))  # already running: not started twice
    assert tasks.start(2, lambda: work(2))
    assert sorted(tasks.keys()) == [1, 2]
    release.set()
    await tasks.wait(1)
    await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    assert sorted(ran) == [1, 2] and done == [1]
    assert tasks.keys() == []
    await tasks.wait(1)  # nothing runs under it: returns at once


def test_close_cancels_every_task_and_waits_for_it() -> None:
    asyncio.run(_close_cancels_every_task_and_waits_for_it())


async def _close_cancels_every_task_and_waits_for_it() -> None:
    tasks: KeyedTasks[str] = KeyedTasks("t")
    cleaned: list[str] = []

    async def forever(key: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(key)

    for key in ("a", "b"):
        tasks.start(key, lambda key=key: forever(key))  # type: ignore[misc]
    await asyncio.sleep(0)
    tasks.cancel("a")
    await tasks.close()
    assert sorted(cleaned) == ["a", "b"] and tasks.keys() == []


def test_a_cancelled_waiter_leaves_the_task_running() -> None:
    asyncio.run(_a_cancelled_waiter_leaves_the_task_running())


async def _a_cancelled_waiter_leaves_the_task_running() -> None:
    tasks: KeyedTasks[int] = KeyedTasks("t")
    release = asyncio.Event()

    async def work() -> None:
        await release.wait()

    tasks.start(1, work)
    waiter = asyncio.create_task(tasks.wait(1))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    assert tasks.keys() == [1]
    release.set()
    await tasks.wait(1)
