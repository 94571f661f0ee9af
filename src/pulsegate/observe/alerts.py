"""Alert webhook: POST JSON on ejection, recovery and panic, off the request path.

`submit` only enqueues (bounded; a full queue drops the oldest alert and counts it); one
worker task posts with a timeout and a few jittered retries. Routing never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp
import orjson

log = logging.getLogger("pulsegate.alerts")


class AlertSender:
    def __init__(
        self,
        url: str | None,
        session: aiohttp.ClientSession,
        timeout: float,
        retries: int,
        rng: random.Random,
        capacity: int = 256,
    ) -> None:
        self.url = url
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._retries = retries
        self._rng = rng
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=capacity)
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.dropped = 0
        self.failed = 0

    def submit(self, alert: dict[str, Any]) -> None:
        log.warning(alert["text"])
        if self.url is None:
            return
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(alert)

    def start(self) -> None:
        if self.url is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="alerts")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        assert self.url is not None
        while True:
            alert = await self._queue.get()
            body = orjson.dumps(alert, default=str)
            for attempt in range(self._retries + 1):
                try:
                    async with self._session.post(
                        self.url,
                        data=body,
                        headers={"content-type": "application/json"},
                        timeout=self._timeout,
                    ) as resp:
                        await resp.read()
                        if resp.status < 500:
                            self.sent += 1
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if attempt == self._retries:
                    self.failed += 1
                    log.warning("alert webhook failed after %d tries", attempt + 1)
                    break
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt) * (0.5 + self._rng.random()))
