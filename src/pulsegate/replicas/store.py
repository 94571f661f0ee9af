"""The Redis shell: every call bounded, never an exception into the caller.

One client (a small connection pool) for commands and one pub/sub connection for the
evidence channel. Every command runs under `CALL_TIMEOUT_S` (0.2 s: a loopback or LAN round
trip is well under 1 ms, so 0.2 s only ever fires on a Redis that is down, stopped or cut
off) and answers None on any failure. redis-py's retries are off; a call whose connection
is refused or broken (a pooled one a Redis restart closed) is tried once more, at once, so
a call takes at most twice the bound. The listener reconnects on its own, at
most every `RECONNECT_S`.

Errors are logged once per change (down, then up again), with the URL's password removed:
`shown_url` is the only form of the URL that leaves this module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger("pulsegate.replicas")

CALL_TIMEOUT_S = 0.2
RECONNECT_S = 0.25
LISTEN_POLL_S = 0.5

T = TypeVar("T")


def shown_url(url: str) -> str:
    """`url` without its user and password (for logs and the admin API)."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host + (f":{u.port}" if u.port else "")
        return urlunsplit((u.scheme, netloc, u.path, "", ""))
    except ValueError:
        return "(unparsable)"


class RedisStore:
    def __init__(self, url: str, timeout: float = CALL_TIMEOUT_S) -> None:
        self.url = shown_url(url)
        self.timeout = timeout
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self.ok = False  # the last call answered
        self.subscribed = False  # the listener holds a live subscription
        self.last_error = ""
        self._script = self._client.register_script  # bound to the client

    async def call(self, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T | None:
        """`fn(client)` within the timeout; None (logged once per outage) on any failure."""
        try:
            try:
                async with asyncio.timeout(self.timeout):
                    out = await fn(self._client)
            except RedisConnectionError:  # maybe a pooled connection a restart broke: once more
                async with asyncio.timeout(self.timeout):
                    out = await fn(self._client)
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            return None
        if not self.ok:
            log.info("redis %s answers", self.url)
        self.ok = True
        return out

    def script(self, source: str) -> Callable[[Sequence[str], Sequence[Any]], Awaitable[Any]]:
        """A Lua script, sent by digest (EVALSHA) and loaded again after a Redis restart."""
        s = self._script(source)

        def run(keys: Sequence[str], args: Sequence[Any]) -> Awaitable[Any]:
            return s(keys=list(keys), args=list(args))

        return run

    async def publish(self, channel: str, data: bytes) -> bool:
        n = await self.call(lambda c: c.publish(channel, data))
        return n is not None

    async def listen(self, channel: str, on_message: Callable[[bytes], None]) -> None:
        """Deliver every message on `channel` to `on_message`, for ever (cancel to stop);
        reconnects after any failure. `subscribed` says whether messages can arrive now."""
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(self.timeout):
                    await pubsub.subscribe(channel)
                self.subscribed = True
                while True:
                    msg = await pubsub.get_message(timeout=LISTEN_POLL_S)
                    if msg is not None and msg.get("type") == "message":
                        data = msg.get("data")
                        if isinstance(data, bytes):
                            _deliver(on_message, data)
            except (RedisError, OSError, TimeoutError) as e:
                self._failed(e)
            finally:
                self.subscribed = False
                # redis-py before 8.2 leaves `aclose` untyped, 8.2 types it: either may be here.
                await _quietly(pubsub.aclose())  # type: ignore[no-untyped-call, unused-ignore]
            await asyncio.sleep(RECONNECT_S)

    async def close(self) -> None:
        await _quietly(self._client.aclose())

    def _failed(self, e: BaseException) -> None:
        what = type(e).__name__ if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        what = what.replace(self.url, "")[:200]
        if self.ok or not self.last_error:
            log.warning("redis %s: %s; working alone until it answers", self.url, what)
        self.ok = False
        self.last_error = what


def _deliver(on_message: Callable[[bytes], None], data: bytes) -> None:
    try:
        on_message(data)
    except Exception:  # one bad message (or a bug folding it) must not stop listening
        log.exception("replicas: a message from the channel could not be folded")


async def _quietly(aw: Awaitable[object]) -> None:
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            await aw
    except Exception:  # closing a broken connection: nothing left to do
        pass
