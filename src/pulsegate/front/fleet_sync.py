"""The I/O of fleet-wide limits (`front/fleet.py`): one report out every `SYNC_S`, the
others' reports in, over a Redis pub/sub channel (`replicas/store.py`: every call bounded,
none raises). Nothing here is on a request's path: a Redis that is down, slow or cut off
only makes this participant work alone (`FleetLimits.tick`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pulsegate.clock import Clock
from pulsegate.front.fleet import HEARTBEAT_S, SYNC_S, FleetLimits
from pulsegate.replicas.store import RedisStore

CHANNEL = "pulsegate:limits"

log = logging.getLogger("pulsegate.front")


class FleetSync:
    def __init__(self, limits: FleetLimits, url: str, clock: Clock) -> None:
        self.limits = limits
        self.clock = clock
        self.store = RedisStore(url)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self.store.listen(CHANNEL, self._fold)),
                asyncio.create_task(self._report_loop()),
            ]

    def _fold(self, data: bytes) -> None:
        self.limits.fold(data, self.clock.now())

    async def _report_loop(self) -> None:
        limits = self.limits
        counted = -1e9
        while True:
            await asyncio.sleep(SYNC_S)
            now = self.clock.now()
            was = limits.alone_n
            limits.tick(now)
            if limits.alone_n and not was:
                log.warning("client limits: reports to the fleet stopped getting out; working "
                            "alone with 1/%d of every limit", limits.alone_n)  # fmt: skip
            if not self.store.subscribed:  # not hearing the others: nothing is delivered
                continue
            if now - counted >= HEARTBEAT_S:
                counted = now
                n = await self.store.call(lambda c: c.pubsub_numsub(CHANNEL))
                if n:
                    limits.subscribers = int(n[0][1])
            out = limits.outbox(now)
            if out is None:  # nothing to say: the channel is as good as its last call
                if self.store.ok:
                    limits.delivered(now)
            elif await self.store.publish(CHANNEL, out):
                was = limits.alone_n
                limits.delivered(self.clock.now())
                if was:
                    log.info("client limits: the fleet's reports flow again; full limits")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await self.store.close()


__all__ = ["CHANNEL", "FleetSync"]
