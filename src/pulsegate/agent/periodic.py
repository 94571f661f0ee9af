"""The agent's refreshers' loop: a step every `period` seconds on the clock's time line,
never piling up behind a slow source, never stopped by a bug in one step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("pulsegate.agent")


async def every(
    period: float, now: Callable[[], float], step: Callable[[], Awaitable[None]], what: str
) -> None:
    """Run `step` every `period` s for ever (cancel to stop); a failing step is logged as
    `agent: {what} failed` and the next one runs on time."""
    next_at = now()
    while True:
        next_at += period
        delay = next_at - now()
        if delay > 0:
            await asyncio.sleep(delay)
        else:  # a slow source: do not pile up, start the next round now
            next_at = now()
        try:
            await step()
        except Exception:  # a bug here must not stop the refresher for good
            log.exception("agent: %s failed", what)


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` (if any) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


__all__ = ["cancel", "every"]
