"""The proxy's own state in one process: what is in flight, who waits, which streams live.

- in-flight counts per backend (`inflight`: this process's; `load`: what routing reads, the
  same dict in one process, the gateway-wide totals in a proxy worker);
- the capacity queue: when every candidate is at its limit, wait, then 503 (R24, R25);
  retries and broken streams' continuations wait at its head (`wait_for_continuation`);
- the live streams and the attempts waiting for a first byte, per backend, so an ejection
  cuts them at once (R21) and a shutdown past its grace ends the streams still open;
- the first-byte watch (`firstbyte.py`) and the drain on shutdown.

Nothing here judges a backend: verdicts come through the `Router`, outcomes leave through
`Outcomes` (`ports.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import TypeVar

from pulsegate.capacity import CapacityQueue
from pulsegate.clock import Clock
from pulsegate.health.verdict import Verdict
from pulsegate.proxy.cuts import SHUTTING_DOWN, Cut
from pulsegate.proxy.deadline import Deadline, sweep
from pulsegate.proxy.firstbyte import WATCH_INTERVAL_S, FirstByteWatch
from pulsegate.proxy.ports import Outcomes, Router, Verdicts
from pulsegate.proxy.watchdog import EJECTED_STALL_S, Watchdog

T = TypeVar("T")

log = logging.getLogger("pulsegate.proxy")


class ProxyState:
    def __init__(
        self,
        names: Iterable[str],
        clock: Clock,
        router: Router,
        verdicts: Verdicts,
        outcomes: Outcomes,
        queue_max: int,
        *,
        inflight: MutableMapping[str, int] | None = None,
        load: Mapping[str, int] | None = None,
    ) -> None:
        names = tuple(names)
        self.clock = clock
        self.router = router
        self.verdicts = verdicts
        self.inflight: MutableMapping[str, int] = (
            inflight if inflight is not None else dict.fromkeys(names, 0)
        )
        self.load: Mapping[str, int] = load if load is not None else self.inflight
        self.queue = CapacityQueue(queue_max, clock.now)
        self.first_byte = FirstByteWatch(names, clock, verdicts.usual_ttft, outcomes.report)
        self._streams: dict[str, set[Watchdog]] = {n: set() for n in names}
        self._pending: dict[str, set[Deadline]] = {n: set() for n in names}
        self.shutting_down = False
        self.drained = asyncio.Event()
        # Removed by a reload while requests to them were in flight: forgotten at the last
        # release (their requests and streams finish where they are).
        self._leaving: set[str] = set()

    # -- in flight ----------------------------------------------------------------------------

    def acquire(self, name: str) -> None:
        self.inflight[name] += 1

    def release(self, name: str) -> None:
        self.inflight[name] -= 1
        if self.queue.depth:
            self.queue.wake_for(self.verdicts.backend_models(name))
        if self.shutting_down and not any(self.inflight.values()):
            self.drained.set()
        if self._leaving and name in self._leaving and not self.inflight[name]:
            self._forget(name)

    # -- reload ---------------------------------------------------------------------------------

    def reconfigure(
        self, names: Iterable[str], router: Router, verdicts: Verdicts, queue_max: int
    ) -> None:
        """A reload: backends added get their rows; removed ones take nothing new (the
        router no longer names them) and are forgotten once their last request ends."""
        names = tuple(names)
        self.router = router
        self.verdicts = verdicts
        self.queue.limit = queue_max
        for n in names:
            self._leaving.discard(n)
            if n not in self._streams:
                self.inflight[n] = 0
                self._streams[n] = set()
                self._pending[n] = set()
        self.first_byte.track(names)
        keep = set(names)
        for n in [n for n in self._streams if n not in keep]:
            if self.inflight.get(n, 0):
                self._leaving.add(n)
            else:
                self._forget(n)

    def _forget(self, name: str) -> None:
        self._leaving.discard(name)
        self.inflight.pop(name, None)
        self._streams.pop(name, None)
        self._pending.pop(name, None)
        self.first_byte.forget(name)

    # -- the capacity queue: when every candidate is at its limit, wait, then 503 -----------

    def queue_ahead(self, model: str) -> bool:
        """Requests for `model` already wait for capacity: a newcomer queues behind them."""
        return self.queue.ahead(model)

    async def wait_for_capacity(
        self,
        model: str,
        session_key: str | None,
        within: float,
        tried: Sequence[str] = (),
        *,
        urgent: bool = False,
    ) -> Verdict | None:
        """Wait in `model`'s FIFO (bounded by routing.queue_max) until a backend for it has
        room, at most `within` seconds; `urgent` (a retry): at the head of the line. None:
        the queue is full or the wait timed out."""
        if self.queue.depth >= self.queue.limit:
            return None
        pick = self.router.pick
        return await self.queue.wait(
            model,
            within,
            lambda: pick(model, tried, session_key),
            lambda: pick(model, (), None) is not None,
            urgent=urgent,
        )

    async def wait_for_continuation(
        self, model: str, tried: Sequence[str], within: float, pick: Callable[[], T | None]
    ) -> T | None:
        """A broken stream found no backend to continue on: when those not yet tried are
        only at their `max_inflight`, wait for a slot at the head of `model`'s queue (the
        client already holds part of the answer: it goes before every newcomer), at most
        `within`; `pick` is the relay's own choice of target. None at once when no backend
        is left at all (nothing would free a slot in time)."""
        if not self.router.saturated(model, tried):
            return None
        router = self.router
        return await self.queue.wait(
            model, within, pick, lambda: router.pick(model, (), None) is not None, urgent=True
        )

    # -- live streams and pending attempts: cut at once when their backend is ejected (R21) -

    def watch_stream(self, name: str, watch: Watchdog) -> None:
        self._streams[name].add(watch)

    def unwatch_stream(self, name: str, watch: Watchdog) -> None:
        self._streams[name].discard(watch)

    def deadline(self, name: str, seconds: float, watched: int | None = None) -> Deadline:
        """The deadline of an attempt on `name` waiting for its first byte: expired by the
        watch loop once `seconds` have passed, or at once if `name` is ejected meanwhile.
        `watched`: the attempt's first-byte watch token, seen when the deadline expires."""
        then = None if watched is None else functools.partial(self.first_byte.seen, name, watched)
        return Deadline(self.clock.now() + seconds, self._pending[name], then)

    def unwatch_pending(self, name: str, cm: Deadline) -> None:
        """Before the scope ends: an ejection from now on must not cut this attempt."""
        self._pending[name].discard(cm)

    def cut_ejected(self, name: str, cause: str) -> None:
        """Backend `name` was ejected: its live streams get the short stall limit, and its
        attempts still waiting for a first byte give up now and move to another backend
        (the client has received nothing yet)."""
        for w in list(self._streams.get(name, ())):
            w.tighten(EJECTED_STALL_S, f"backend ejected ({cause})")
        for cm in list(self._pending.get(name, ())):
            cm.expire()

    # -- shutdown -----------------------------------------------------------------------------

    def end_streams(self, why: Cut = SHUTTING_DOWN) -> int:
        """Cut every live upstream stream (graceful shutdown past its grace period)."""
        n = 0
        for watches in self._streams.values():
            for w in list(watches):
                w.cut(why)
                n += 1
        return n

    async def wait_drained(self, within: float) -> bool:
        """During shutdown: wait until nothing is in flight, at most `within` seconds."""
        if not any(self.inflight.values()):
            return True
        try:
            async with asyncio.timeout(within):
                await self.drained.wait()
        except TimeoutError:
            return False
        return True

    async def watch_first_bytes(self) -> None:
        """The driver of the first-byte watch and of the attempts' deadlines: a task for
        the life of the process."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = self.clock.now()
            for waiting in self._pending.values():
                if waiting:
                    sweep(waiting, now)
            try:  # a bug here must not end the loop: the deadlines above depend on it
                self.first_byte.check(now)
            except Exception:
                log.exception("first-byte watch failed")
