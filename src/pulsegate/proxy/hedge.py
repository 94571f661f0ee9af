"""Hedged first token (`retry.hedge`): a stream whose first token is late asks a second backend.

A stream's first attempt waits for its first byte; once that wait is past `factor` x the
usual time to first token (`hedge_after`), the same request goes to the next best backend
too, and the late backend is reported suspect (`health/suspect.py`: its weight x 0.05 until a
request there is answered sooner than that), so the next streams avoid it before any probe
fails. The first of the two to produce a byte wins and carries the stream; the other is
cancelled at once (the attempt opener closes its upstream, so the engine stops generating
for nobody) and counted (`pulsegate_hedges_total{outcome}`). Nothing reaches the client
before a winner exists, and only the winner's bytes ever do: no duplicate byte.

"Usual" is the fleet's, not the late backend's own: a backend 1.5 s late has a 1.5 s p95,
and a hedge judged by it would never fire. So it is the smaller of the backend's own TTFT
p95 and the lower median of the p95s of the model's routable backends (`rhythm.py`); with
none known (a fresh gateway) there is no hedge.

Hedges are bounded by a token bucket (`RetryBudget`, `budget` per request, a burst of
`BURST`): a fleet slow everywhere does not double its own load. Never for what resume
refuses (n > 1, constrained decoding), for tools, or outside chat and completions (a
Responses request stores state where it runs; two would store two).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from pulsegate import stall
from pulsegate.clock import Clock, Handle
from pulsegate.config.schema import HedgeConfig
from pulsegate.proxy.attempt import AttemptOpener, Failure, Opened
from pulsegate.proxy.budget import RetryBudget
from pulsegate.proxy.dialects.base import StreamState
from pulsegate.proxy.dialects.chat import resume_refusal
from pulsegate.proxy.exchange import Exchange
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.ports import Router, Verdicts
from pulsegate.proxy.request import ProxyRequest
from pulsegate.proxy.state import ProxyState
from pulsegate.proxy.targets import Target

# Never hedge sooner than this: below it a second prefill costs more than the wait.
FLOOR_S = 0.05
# The TTFT quantile a late first token is judged by.
TTFT_Q = 0.95
# The bucket's burst: hedges a quiet gateway may send at once before the ratio rules.
BURST = 2.0
_APIS = ("chat", "completions")

Result = Opened | Failure


def refusal(req: ProxyRequest) -> str | None:
    """Why `req` is never hedged, or None: the rules of resume, plus tools."""
    if not req.stream:
        return "not a stream"
    if req.api not in _APIS:
        return f"the {req.api} API is not hedged"
    if req.doc.get("tools"):
        return "tools"
    return resume_refusal(req.doc, StreamState())


def hedge_after(factor: float, own_p95: float | None, fleet_p95: float | None) -> float | None:
    """Seconds after which a first byte is late enough to hedge, or None: not known.

    Worked example (factor 2): healthy peers' TTFT p95 40 ms, this backend's own 1.5 s:
    2 x min(1.5, 0.04) = 80 ms. Both 20 ms: max(FLOOR_S, 40 ms) = 50 ms."""
    known = [x for x in (own_p95, fleet_p95) if x is not None]
    if not known:
        return None
    return max(FLOOR_S, factor * min(known))


class Hedger:
    """Opens a stream's first attempt, hedged when its first byte is late."""

    __slots__ = (
        "_clock",
        "_metrics",
        "_opener",
        "_router",
        "_state",
        "_targets",
        "_verdicts",
        "budget",
        "cfg",
    )

    def __init__(
        self,
        cfg: HedgeConfig,
        targets: Mapping[str, Target],
        opener: AttemptOpener,
        state: ProxyState,
        router: Router,
        verdicts: Verdicts,
        metrics: ProxyMetrics,
        clock: Clock,
    ) -> None:
        self.cfg = cfg
        self._targets = targets
        self._opener = opener
        self._state = state
        self._router = router
        self._verdicts = verdicts
        self._metrics = metrics
        self._clock = clock
        self.budget = RetryBudget(cfg.budget, 0.0, clock.now(), cap=BURST)

    def after(self, target: Target, model: str) -> float | None:
        """When a first byte from `target` is late (`hedge_after`)."""
        rhythms = self._opener.rhythms
        names = [v.name for v in self._verdicts.routable(model)]
        own = rhythms.ttft(target.name).quantile(TTFT_Q)
        return hedge_after(self.cfg.factor, own, rhythms.usual_ttft(names, TTFT_Q))

    async def open(self, target: Target, req: ProxyRequest, ex: Exchange) -> Result:
        """The first attempt of `req` on `target` (acquired by the caller), hedged if late.
        An `Opened` on another target: the hedge won and holds that target acquired; the
        caller still holds `target`. Anything else: only `target` is held."""
        opener = self._opener
        after = None
        if refusal(req) is None:
            self.budget.deposit(self._clock.now())
            after = self.after(target, req.model)
        if after is None:
            return await opener.open(target, req.path, req.body, True, req.deadline, ex)
        first = asyncio.create_task(opener.open(target, req.path, req.body, True, req.deadline, ex))
        tasks = [first]
        try:
            if not await self._late(first, after):
                return first.result()
            # Late against its peers: the backend is suspect now (its weight x 0.05 until a
            # success quicker than `after`), so the next streams go elsewhere, hedge or not.
            opener.late(target.name, after)
            return await self._hedge(first, tasks, req, ex)
        finally:
            for t in tasks:
                t.cancel()
            # The loser's upstream is closed before the stream goes on (`wait` raises
            # nothing of theirs: a cancellation of our own still goes through).
            await asyncio.wait(tasks)

    async def _late(self, first: asyncio.Task[Result], after: float) -> bool:
        """Whether `first` still waits after `after` seconds of our running time (our own
        loop's stalls do not make a backend late: `pulsegate.stall`)."""
        clock = self._clock
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        start = clock.now()
        handles: list[Handle] = []  # the timer, then each push-back

        def fire() -> None:
            again = stall.look_again(clock, start, after, clock.now(), len(handles) - 1)
            if again is not None:
                handles.append(clock.call_at(again, fire))
            elif not timer.done():
                timer.set_result(None)

        handles.append(clock.call_later(after, fire))
        try:
            await asyncio.wait((first, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            handles[-1].cancel()
        return not first.done()

    async def _hedge(
        self,
        first: asyncio.Task[Result],
        tasks: list[asyncio.Task[Result]],
        req: ProxyRequest,
        ex: Exchange,
    ) -> Result:
        """`first` is late: send the hedge (if a backend and the budget allow) and race."""
        count = self._metrics.hedges.inc
        v = self._router.pick(req.model, [*ex.backends, *req.avoid], req.session_key)
        if v is None:
            count(("no_backend",))
            return await first
        now = self._clock.now
        if not self.budget.try_withdraw(now()):
            count(("no_budget",))
            return await first
        other, state = self._targets[v.name], self._state
        primary = ex.attempts[-1]
        ex.backends.append(other.name)
        ex.hedges += 1
        state.acquire(other.name)
        at = ex.attempt(other.name, now())
        second = asyncio.create_task(
            self._opener.open(other, req.path, req.body, True, req.deadline, ex)
        )
        tasks.append(second)
        won: Result | None = None
        try:
            won = await _race(first, second)
        finally:
            hedged = isinstance(won, Opened) and won.target is other
            if not hedged:
                state.release(other.name)
            _close_extra(won, (first, second))
        at.end = now()
        if isinstance(won, Opened) and hedged:
            count(("hedge_won",))
            r1 = first.result() if first.done() and not first.cancelled() else None
            primary.end, primary.outcome = now(), "hedge_lost"
            if isinstance(r1, Failure):  # it had failed meanwhile: say so
                primary.status, primary.outcome = r1.status, r1.outcome.value
            at.status, at.outcome = won.resp.status, "ok"
            return won
        r2 = second.result() if second.done() and not second.cancelled() else None
        if isinstance(r2, Failure):
            count(("hedge_failed",))
            at.status, at.outcome = r2.status, r2.outcome.value
        else:
            count(("primary_won",))
            at.outcome = "hedge_lost"
        return won


async def _race(a: asyncio.Task[Result], b: asyncio.Task[Result]) -> Result:
    """The first `Opened` of the two (`a` when both are there at once), else `a`'s
    failure once both failed."""
    pending: set[asyncio.Task[Result]] = {a, b}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in (a, b):
            if t in done and isinstance(t.result(), Opened):
                return t.result()
    return a.result()


def _close_extra(won: Result | None, tasks: tuple[asyncio.Task[Result], ...]) -> None:
    """Both answered in the same loop turn: the one that did not win is closed unread."""
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            r = t.result()
            if isinstance(r, Opened) and r is not won:
                r.resp.close()
