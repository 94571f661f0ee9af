"""The Redis shell and the lease script against a real redis-server on loopback."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import pytest

from pulsegate.replicas import membership
from pulsegate.replicas.membership import Members
from pulsegate.replicas.store import CALL_TIMEOUT_S, RedisStore, shown_url
from replicas.redis_server import RedisServer

KEYS = [membership.LEASES_KEY, membership.JOINED_KEY]


def test_the_password_never_shows() -> None:
    """The URL as logged and shown has no user or password."""
    assert shown_url("redis://user:s3cret@10.0.0.1:6380/2") == "redis://10.0.0.1:6380/2"
    assert "s3cret" not in shown_url("rediss://:s3cret@[::1]/0")


def test_members_read_ages() -> None:
    """A reply [now, id, expiry, joined]: lease age from expiry - 3 s, age from joined."""
    m = Members.read([b"10000", b"r1", b"12500", b"4000", b"r0", b"13000", b"9000"])
    assert m.ids == ("r0", "r1")
    assert m.members[1].lease_age_s == pytest.approx(0.5) and m.members[1].age_s == pytest.approx(
        6.0
    )
    with pytest.raises(ValueError):
        Members.read([b"1", b"r1"])


async def test_leases_expire_and_leave(redis_server: RedisServer) -> None:
    """Two leases live together; one not renewed is gone after its ttl; ttl 0 leaves at once."""
    store = RedisStore(redis_server.url)
    renew = store.script(membership.RENEW_LUA)
    try:
        await store.call(lambda c: renew(KEYS, ["a", 200]))
        reply = await store.call(lambda c: renew(KEYS, ["b", 3000]))
        assert reply is not None and Members.read(reply).ids == ("a", "b")
        deadline = time.monotonic() + 3
        ids: tuple[str, ...] = ("a", "b")
        while "a" in ids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            reply = await store.call(lambda c: renew(KEYS, ["b", 3000]))
            assert reply is not None
            ids = Members.read(reply).ids
        assert ids == ("b",)
        reply = await store.call(lambda c: renew(KEYS, ["b", 0]))
        assert reply is not None and Members.read(reply).ids == ()
    finally:
        await store.close()


async def test_a_stopped_redis_answers_none_within_the_bound(redis_server: RedisServer) -> None:
    """SIGSTOP: the call gives up after its 0.2 s timeout with None; SIGCONT: it answers again."""
    store = RedisStore(redis_server.url)
    try:
        assert await store.call(lambda c: c.ping()) is True and store.ok
        redis_server.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert await store.call(lambda c: c.ping()) is None
        assert time.monotonic() - t0 < CALL_TIMEOUT_S + 0.2
        assert not store.ok
        redis_server.signal(signal.SIGCONT)
        for _ in range(100):  # 5 s
            if await store.call(lambda c: c.ping()):
                break
            await asyncio.sleep(0.05)
        assert store.ok
    finally:
        redis_server.signal(signal.SIGCONT)
        await store.close()


async def test_a_dead_redis_answers_none(redis_server: RedisServer) -> None:
    """SIGKILL: None at once, never an exception; restarted: the lease script works again."""
    store = RedisStore(redis_server.url)
    renew = store.script(membership.RENEW_LUA)
    try:
        assert await store.call(lambda c: renew(KEYS, ["a", 3000])) is not None
        redis_server.kill()
        assert await store.call(lambda c: renew(KEYS, ["a", 3000])) is None
        redis_server.start()  # empty: the script must be loaded again (NOSCRIPT)
        deadline = time.monotonic() + 5
        reply = None
        while reply is None and time.monotonic() < deadline:
            reply = await store.call(lambda c: renew(KEYS, ["a", 3000]))
            await asyncio.sleep(0.05)
        assert reply is not None and Members.read(reply).ids == ("a",)
    finally:
        await store.close()


async def test_listen_delivers_and_resubscribes(redis_server: RedisServer) -> None:
    """Published messages arrive; after a Redis restart the listener subscribes again."""
    store = RedisStore(redis_server.url)
    got: list[bytes] = []
    task = asyncio.create_task(store.listen("ch", got.append))

    async def until(cond: Callable[[], bool], what: str) -> None:
        for _ in range(250):  # 5 s
            if cond():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    try:
        await until(lambda: store.subscribed, "subscribed")
        assert await store.publish("ch", b"one")
        await until(lambda: got == [b"one"], "first message")
        redis_server.kill()
        await until(lambda: not store.subscribed, "unsubscribed")
        redis_server.start()
        await until(lambda: store.subscribed, "subscribed again")
        assert await store.publish("ch", b"two")
        await until(lambda: got == [b"one", b"two"], "second message")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()
