"""The capacity queue's order: FIFO per model, newcomers never overtake, places are kept.

A tiny slot pool stands in for backends at their limit: `pick` takes a free slot or finds
none, `free` gives one back and wakes a waiter as `Gateway.release` does. Nothing sleeps:
each step runs the loop until the woken waiter has had its turn.
"""

from __future__ import annotations

import asyncio

import pytest

from pulsegate.capacity import CapacityQueue


class Slots:
    def __init__(self, queue: CapacityQueue, free: int = 0) -> None:
        self.queue = queue
        self.free_slots = free

    def pick(self) -> str | None:
        if self.free_slots <= 0:
            return None
        self.free_slots -= 1
        return "slot"

    def has_room(self) -> bool:
        return self.free_slots > 0

    def free(self, models: tuple[str, ...] = ("m",)) -> None:
        self.free_slots += 1
        self.queue.wake_for(models)


async def _settle(tasks: list[asyncio.Task[object]], done: list[str], want: int) -> None:
    """Run the loop until `want` waiters are served (bounded: 100 turns)."""
    for _ in range(100):
        if len(done) >= want:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"only {done} served, wanted {want}")


async def _waiter(q: CapacityQueue, slots: Slots, name: str, done: list[str]) -> None:
    got = await q.wait("m", 5.0, slots.pick, slots.has_room)
    if got is not None:
        done.append(name)


@pytest.mark.asyncio
async def test_waiters_are_served_in_arrival_order() -> None:
    q = CapacityQueue(100)
    slots = Slots(q)
    done: list[str] = []
    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(_waiter(q, slots, f"w{i}", done)))
        await asyncio.sleep(0)
    assert q.depth == 5 and q.ahead("m")
    for i in range(5):
        slots.free()
        await _settle(tasks, done, i + 1)
    assert done == ["w0", "w1", "w2", "w3", "w4"]
    assert q.depth == 0 and not q.ahead("m")
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_a_newcomer_at_release_time_queues_behind() -> None:
    """Between a release and the woken waiter's turn a newcomer sees others ahead of it."""
    q = CapacityQueue(100)
    slots = Slots(q)
    done: list[str] = []
    first = asyncio.create_task(_waiter(q, slots, "queued", done))
    await asyncio.sleep(0)
    slots.free()  # wakes "queued", which has not run yet
    assert q.ahead("m"), "a newcomer would take the slot the queued request was woken for"
    late = asyncio.create_task(_waiter(q, slots, "newcomer", done))
    await _settle([first, late], done, 1)
    assert done == ["queued"]
    slots.free()
    await _settle([first, late], done, 2)
    assert done == ["queued", "newcomer"]
    await asyncio.gather(first, late)


@pytest.mark.asyncio
async def test_a_woken_waiter_whose_slot_was_taken_keeps_its_place() -> None:
    q = CapacityQueue(100)
    slots = Slots(q)
    done: list[str] = []
    tasks = [asyncio.create_task(_waiter(q, slots, n, done)) for n in ("a", "b")]
    await asyncio.sleep(0)
    q.wake_for(("m",))  # "a" woken, but no slot is free when it looks (a retry took it)
    for _ in range(5):
        await asyncio.sleep(0)
    assert done == [] and q.depth == 2
    slots.free()
    await _settle(tasks, done, 1)
    assert done == ["a"], "the waiter that lost its slot went to the back"
    slots.free()
    await _settle(tasks, done, 2)
    assert done == ["a", "b"]
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_several_slots_freed_at_once_serve_several_waiters() -> None:
    """One wake per release, but a served waiter wakes the next: no slot stays idle."""
    q = CapacityQueue(100)
    slots = Slots(q)
    done: list[str] = []
    tasks = [asyncio.create_task(_waiter(q, slots, f"w{i}", done)) for i in range(3)]
    await asyncio.sleep(0)
    slots.free_slots = 3  # capacity came back without releases (e.g. a backend rejoined)
    q.wake_for(("m",))
    await _settle(tasks, done, 3)
    assert done == ["w0", "w1", "w2"]
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_release_wakes_a_waiter_of_a_model_the_backend_serves() -> None:
    q = CapacityQueue(100)
    got: list[str] = []

    async def wait(model: str) -> None:
        if await q.wait(model, 5.0, lambda: model, lambda: True) is not None:
            got.append(model)

    ta = asyncio.create_task(wait("a"))
    await asyncio.sleep(0)
    tb = asyncio.create_task(wait("b"))
    await asyncio.sleep(0)
    q.wake_for(("b",))  # the freed backend serves only model b
    for _ in range(5):
        await asyncio.sleep(0)
    assert got == ["b"] and q.ahead("a") and not q.ahead("b")
    q.wake_for(("a", "b"))
    await asyncio.wait_for(asyncio.gather(ta, tb), 5)
    assert got == ["b", "a"]


@pytest.mark.asyncio
async def test_full_queue_and_deadline_give_none() -> None:
    q = CapacityQueue(1)
    slots = Slots(q)
    waiting = asyncio.create_task(q.wait("m", 0.05, slots.pick, slots.has_room))
    await asyncio.sleep(0)
    assert await q.wait("m", 5.0, slots.pick, slots.has_room) is None  # full: refused at once
    assert await waiting is None  # nothing freed within its 50 ms
    assert q.depth == 0 and not q.ahead("m")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def _serve_one(slots: Slots, done: list[str], clock: Clock, dt: float) -> None:
    clock.t += dt
    want = len(done) + 1
    slots.free()
    await _settle([], done, want)


@pytest.mark.asyncio
async def test_a_newcomer_that_cannot_be_served_in_time_is_refused_at_once() -> None:
    """Waiters served 0.1 s apart, 2 s to wait (a newcomer queues within 3/4 of it): 14
    ahead is about 1.4 s (queued), 25 ahead is 2.5 s (refused without waiting); the refusal
    takes no place in the queue."""
    clock = Clock()
    q = CapacityQueue(1000, now=clock)
    slots = Slots(q)
    done: list[str] = []

    async def waiter(name: str, within: float = 2.0) -> str | None:
        got = await q.wait("m", within, slots.pick, slots.has_room)
        if got is not None:
            done.append(name)
        return got

    tasks = [asyncio.create_task(waiter(f"w{i}")) for i in range(40)]
    for _ in range(3):
        await asyncio.sleep(0)
    for _ in range(15):  # learn the interval: 0.1 s
        await _serve_one(slots, done, clock, 0.1)
    assert q.depth == 25
    refused = asyncio.create_task(waiter("late"))
    await asyncio.sleep(0)
    assert refused.done() and refused.result() is None and q.depth == 25
    for _ in range(9):
        await _serve_one(slots, done, clock, 0.1)
    assert q.depth == 16
    still = asyncio.create_task(waiter("still late"))  # 1.6 s > 1.5 s
    await asyncio.sleep(0)
    assert still.done() and still.result() is None
    for _ in range(2):
        await _serve_one(slots, done, clock, 0.1)
    assert q.depth == 14
    queued = asyncio.create_task(waiter("in time"))
    await asyncio.sleep(0)
    assert not queued.done() and q.depth == 15
    for t in [*tasks, queued]:
        t.cancel()
    await asyncio.gather(*tasks, queued, return_exceptions=True)


@pytest.mark.asyncio
async def test_after_an_idle_queue_a_burst_is_not_refused() -> None:
    """A minute without waiters does not count as a minute without service: a burst then
    queues (the time since the last served counts from the longest waiter's arrival)."""
    clock = Clock()
    q = CapacityQueue(1000, now=clock)
    slots = Slots(q)
    done: list[str] = []
    first = asyncio.create_task(q.wait("m", 2.0, slots.pick, slots.has_room))
    await asyncio.sleep(0)
    clock.t += 0.1
    slots.free()
    for _ in range(5):
        await asyncio.sleep(0)
    assert first.done() and first.result() == "slot"
    clock.t += 60.0
    burst = [asyncio.create_task(q.wait("m", 2.0, slots.pick, slots.has_room)) for _ in range(5)]
    await asyncio.sleep(0)
    assert q.depth == 5 and not any(t.done() for t in burst)
    for t in burst:
        t.cancel()
    await asyncio.gather(*burst, return_exceptions=True)
    assert done == []


@pytest.mark.asyncio
async def test_urgent_waiters_go_before_newcomers_in_their_own_order() -> None:
    """A retry or a broken stream's continuation (urgent) is served before every waiter
    already queued, urgent ones among themselves first come first served."""
    q = CapacityQueue(100)
    slots = Slots(q)
    done: list[str] = []

    async def waiter(name: str, urgent: bool) -> None:
        if await q.wait("m", 5.0, slots.pick, slots.has_room, urgent=urgent) is not None:
            done.append(name)

    order = [("n0", False), ("n1", False), ("u0", True), ("n2", False), ("u1", True)]
    tasks = []
    for name, urgent in order:
        tasks.append(asyncio.create_task(waiter(name, urgent)))
        await asyncio.sleep(0)
    for i in range(len(order)):
        slots.free()
        await _settle(tasks, done, i + 1)
    assert done == ["u0", "u1", "n0", "n1", "n2"]
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_an_urgent_waiter_is_not_refused_for_the_expected_wait() -> None:
    """25 waiters ahead at 0.1 s apart refuse a newcomer at once (2.5 s > 3/4 of 2 s), but an
    urgent one queues at the head and gets the next slot."""
    clock = Clock()
    q = CapacityQueue(1000, now=clock)
    slots = Slots(q)
    done: list[str] = []

    async def waiter(name: str, urgent: bool = False) -> str | None:
        got = await q.wait("m", 2.0, slots.pick, slots.has_room, urgent=urgent)
        if got is not None:
            done.append(name)
        return got

    tasks = [asyncio.create_task(waiter(f"w{i}")) for i in range(40)]
    for _ in range(3):
        await asyncio.sleep(0)
    for _ in range(15):
        await _serve_one(slots, done, clock, 0.1)
    assert q.depth == 25
    refused = asyncio.create_task(waiter("late"))
    urgent = asyncio.create_task(waiter("retry", urgent=True))
    await asyncio.sleep(0)
    assert refused.done() and refused.result() is None
    assert not urgent.done() and q.depth == 26
    await _serve_one(slots, done, clock, 0.1)
    assert done[-1] == "retry"
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, urgent, return_exceptions=True)
