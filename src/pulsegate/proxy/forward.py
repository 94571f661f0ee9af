"""The proxy path: parse the few fields routing needs, pick, forward bytes, retry.

Per request this reads the body once, parses it once (`request.py`), and forwards the
original bytes unchanged. Retries are only possible while nothing has reached the client: a
non-streamed answer is buffered whole before it is sent, a stream is committed at its first
body chunk (then `relay.py` owns it). Never the same backend twice for one request; at most
`retry.max_attempts` tries, and retries beyond the first also need the retry budget.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping, Sequence

import orjson
from aiohttp import web

from pulsegate.clock import Clock
from pulsegate.config import Config
from pulsegate.health.observations import Outcome
from pulsegate.proxy.affinity import (
    ResponseAffinity,
    pinned_avoid,
    previous_id,
    unavailable_message,
)
from pulsegate.proxy.attempt import AttemptOpener, Failure
from pulsegate.proxy.budget import RetryBudget
from pulsegate.proxy.client_out import BodyTooLarge, Incoming, StreamOut, Whole
from pulsegate.proxy.dialects.token_ids import first_body
from pulsegate.proxy.errors import error_response
from pulsegate.proxy.exchange import CLIENT_CLOSED, Door, Exchange, Recorder
from pulsegate.proxy.hedge import Hedger
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.ports import Outcomes, Router, Verdicts
from pulsegate.proxy.relay import Relay, StreamSettings
from pulsegate.proxy.request import (
    API,
    Limits,
    ProxyRequest,
    Rejection,
    body_too_slow,
    parse,
    too_large,
)
from pulsegate.proxy.state import ProxyState
from pulsegate.proxy.stops import cut_answer
from pulsegate.proxy.targets import Target
from pulsegate.proxy.upstream import Response as UpstreamResponse

# What the forwarder answers: a backend's whole answer, one of the gateway's own (an error,
# a refusal), or a stream already relayed.
Answer = Whole | web.Response | StreamOut

# Response headers from the backend that we pass on; everything else (hop-by-hop,
# server identity, content-length recomputed by aiohttp's server) is dropped.
_PASS_HEADERS = ("content-type", "content-encoding", "x-request-id", "retry-after")


class Forwarder:
    def __init__(
        self,
        config: Config,
        targets: Mapping[str, Target],
        state: ProxyState,
        router: Router,
        verdicts: Verdicts,
        outcomes: Outcomes,
        opener: AttemptOpener,
        metrics: ProxyMetrics,
        clock: Clock,
        budget: RetryBudget,
        door: Door | None = None,
        recorders: Sequence[Recorder] = (),
        affinity: ResponseAffinity | None = None,
    ) -> None:
        self.targets = targets
        # Responses: response id -> the backend holding its state (`affinity.py`).
        self.affinity = affinity if affinity is not None else ResponseAffinity()
        self.door = door
        self.recorders = tuple(recorders)
        # Someone reads the answer's token counts: a non-streamed answer's `usage` is parsed.
        self.wants_usage = door is not None or bool(self.recorders)
        self.state = state
        self.router = router
        self.verdicts = verdicts
        self.opener = opener
        self.metrics = metrics
        self.clock = clock
        r = config.retry
        self.limits = Limits.of(config)
        self.max_attempts = r.max_attempts
        self.queue_timeout = config.routing.queue_timeout
        # A body still arriving gets `gateway.client_body_timeout` (30 s) to arrive whole: a
        # client trickling it (slow-body slowloris) held its connection, handler and up to
        # `max_body_bytes` of buffer for as long as it went on (issue #22).
        self.body_timeout = config.gateway.client_body_timeout
        self.budget = budget
        # `resume: none`: an engine that cannot continue a stream is never a continuation
        # target, whatever engine the stream broke on.
        resume_unable = tuple(n for n, t in targets.items() if t.resume == "none")
        s = config.streaming
        self.streaming = StreamSettings(
            resume=s.resume,
            max_resumes=s.max_resumes,
            stall=s.stall_timeout,
            per_try=r.per_try_timeout,
            request_timeout=r.request_timeout,
            max_attempts=r.max_attempts,
            resume_unable=resume_unable,
            stall_floor=s.stall_floor,
            stall_factor=s.stall_factor,
            queue_timeout=config.routing.queue_timeout,
        )
        # `retry.hedge` (`hedge.py`): a stream's late first token asked of a second backend.
        h = r.hedge
        self.hedger = (
            Hedger(h, targets, opener, state, router, verdicts, metrics, clock)
            if h.enabled
            else None
        )
        self.outcomes = outcomes

    async def handle(self, request: Incoming, path: str) -> Answer:
        clock = self.clock
        headers = request.headers
        ex = Exchange(clock.now(), time.time(), path, API.get(path, path))
        ex.traceparent = headers.get("traceparent")
        try:
            resp = await self._handle(request, path, ex)
            ex.status = resp.status
            return resp
        except asyncio.CancelledError:
            ex.status = CLIENT_CLOSED
            raise
        finally:
            ex.end = clock.now()
            self.metrics.api_requests.inc((ex.api, str(ex.status)))
            if ex.ticket is not None and self.door is not None:
                self.door.settle(ex, ex.end)
            for r in self.recorders:
                r.record(ex)

    async def _handle(self, request: Incoming, path: str, ex: Exchange) -> Answer:
        door = self.door
        if door is not None:
            refused = door.identify(request.headers, ex)
            if refused is not None:
                return _rejected(refused, ex)
        max_body = self.limits.max_body
        cl = request.content_length
        if cl is not None and cl > max_body:
            return _rejected(too_large(max_body), ex)
        try:
            if request.body_arrived():  # the body came with the head (most): no timer
                body = await request.read()
            else:
                async with asyncio.timeout(self.body_timeout):
                    body = await request.read()
        except BodyTooLarge:
            return _rejected(too_large(max_body), ex)
        except TimeoutError:
            return _rejected(body_too_slow(self.body_timeout), ex)
        req = parse(path, body, request.headers.get("x-session-id"), self.limits)
        if isinstance(req, Rejection):
            return _rejected(req, ex)
        ex.model = req.model
        ex.stream = req.stream
        if door is not None:
            refused = door.admit(req, ex, self.clock.now())
            if refused is not None:
                return _rejected(refused, ex)
        return await self.route(request, req, ex)

    # -- routing and retries --------------------------------------------------------------

    async def route(self, request: Incoming, req: ProxyRequest, ex: Exchange) -> Answer:
        """Try backends until one answers; never one in `req.avoid` (it cannot serve this
        request: `n` beyond its `max_n`)."""
        now = self.clock.now
        start = now()
        self.budget.deposit(start)
        model = req.model
        if not self.verdicts.serves(model):
            ex.error = "model_not_found"
            return error_response(
                404, f"model '{model}' is not served by any backend", "model_not_found"
            )
        state, router, metrics = self.state, self.router, self.metrics
        home = self._home(req)  # previous_response_id: only the backend holding its state
        avoid = req.avoid if home is None else pinned_avoid(home, self.targets)
        tried = ex.backends
        last: Failure | None = None
        while len(tried) < self.max_attempts:
            # Requests already queued for this model go first: a newcomer queues behind them.
            ahead = not tried and state.queue_ahead(model)
            skip = [*tried, *avoid] if avoid else tried
            verdict = None if ahead else router.pick(model, skip, req.session_key)
            if verdict is None and (ahead or router.saturated(model, skip)):
                # Backends not yet tried are only at their concurrency limit: wait in the
                # bounded queue rather than bury a survivor (R24, R25), retries included.
                if state.queue.depth < state.queue.limit:
                    metrics.queued.inc()
                # A retry was admitted already: it waits at the head of the line.
                verdict = await state.wait_for_capacity(
                    model, req.session_key, self.queue_timeout, skip, urgent=bool(tried)
                )
                if verdict is None:
                    ex.error = "overloaded"
                    return _overloaded(model)
            if verdict is None:
                break
            if tried:
                if not self.budget.try_withdraw(now()):
                    metrics.retries.inc(("budget_exhausted",))
                    break
                metrics.retries.inc((last.outcome.value if last else "unknown",))
            tried.append(verdict.name)
            result = await self._attempt(request, self.targets[verdict.name], req, ex)
            if not isinstance(result, Failure):
                metrics.request_seconds.observe(now() - start)
                return result
            last = result
            metrics.requests.inc((verdict.name, model, str(result.status or result.outcome.value)))
            if result.response is not None:  # the request's own fault: no retry
                ex.error = "upstream_client_error"
                return result.response
        metrics.request_seconds.observe(now() - start)
        if home is not None and last is None:
            ex.error = "previous_response_unavailable"
            msg = unavailable_message(req.doc["previous_response_id"], home)
            return error_response(503, msg, ex.error, {"retry-after": "1"})
        final = _final_error(model, tried, last)
        ex.error = final[1]
        return final[0]

    async def _attempt(
        self, request: Incoming, target: Target, req: ProxyRequest, ex: Exchange
    ) -> Answer | Failure:
        state = self.state
        name = target.name
        tried = ex.backends
        now = self.clock.now
        state.acquire(name)
        handed_off = False
        at = ex.attempt(name, now())
        try:
            if self.hedger is not None and req.stream:
                opened = await self.hedger.open(target, req, ex)
            else:
                body = first_body(req, target, self.streaming.resume)  # + return_token_ids
                opened = await self.opener.open(
                    target, req.path, body, req.stream, req.deadline, ex
                )
            if isinstance(opened, Failure):
                at.end = now()
                at.status = opened.status
                at.outcome = opened.outcome.value
                return opened
            if opened.target is not target:  # a hedge won (`hedge.py`): it holds the stream
                state.release(name)
                target, name, at = opened.target, opened.target.name, ex.attempts[-1]
            status = opened.resp.status
            at.status = status
            at.outcome = "ok"
            ex.ttft = now() - ex.start
            headers = _response_headers(opened.resp, name, len(tried), ex.reply_headers)
            if not req.stream:
                at.end = now()
                data = opened.first
                if req.stops and status == 200:
                    data = cut_answer(data, req.stops)
                if self.wants_usage:
                    _usage(data, ex)
                if req.api == "responses" and status == 200:
                    self.affinity.learn_answer(data, name)
                self.metrics.requests.inc((name, req.model, str(status)))
                return Whole(status, headers, data)
            handed_off = True
            relay = Relay(
                request,
                req,
                ex,
                self.streaming,
                state,
                self.opener,
                functools.partial(self._continuation, req),
                self.targets,
                self.outcomes,
                self.metrics,
                self.clock,
                functools.partial(self.affinity.learn, backend=name)
                if req.api == "responses"
                else None,
            )
            return await relay.run(opened, headers)
        finally:
            if not handed_off:
                state.release(name)

    def _home(self, req: ProxyRequest) -> str | None:
        """The backend a Responses request must go to: the one that produced its
        `previous_response_id`, when this process remembers it."""
        if req.api != "responses":
            return None
        prev = previous_id(req.doc)
        return None if prev is None else self.affinity.home(prev)

    def _continuation(self, req: ProxyRequest, tried: Sequence[str]) -> Target | None:
        """The backend a broken stream of `req` would continue on now: not tried yet for
        this request and able to continue a stream."""
        skip = [*tried, *req.avoid, *self.streaming.resume_unable]  # avoid: not its API, max_n
        v = self.router.pick(req.model, skip, req.session_key)
        return None if v is None else self.targets[v.name]


def retry_budget(cfg: Config, now: float) -> RetryBudget:
    """The retry budget `retry.budget_ratio` / `budget_min_per_s` describe, full at `now`."""
    return RetryBudget(cfg.retry.budget_ratio, cfg.retry.budget_min_per_s, now)


def _response_headers(
    resp: UpstreamResponse, name: str, attempts: int, extra: Mapping[str, str] | None
) -> dict[str, str]:
    h = {"x-pulsegate-backend": name, "x-pulsegate-attempts": str(attempts)}
    rh = resp.headers
    for k in _PASS_HEADERS:
        v = rh.get(k)
        if v is not None:
            h[k] = v
    if extra:
        h.update(extra)
    return h


def _usage(data: bytes, ex: Exchange) -> None:
    """The token counts of a non-streamed answer's `usage`, when it has one."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if isinstance(usage, dict):
        record_usage(usage, ex)


def record_usage(usage: dict[str, object], ex: Exchange) -> None:
    """Token counts from an answer's `usage`: OpenAI's chat and completions name them
    prompt/completion tokens, the Responses API and Anthropic's Messages input/output."""
    p = usage.get("prompt_tokens", usage.get("input_tokens"))
    c = usage.get("completion_tokens", usage.get("output_tokens"))
    if isinstance(p, int):
        ex.tokens_in = p
    if isinstance(c, int):
        ex.tokens_out = c


def _rejected(r: Rejection, ex: Exchange) -> web.Response:
    ex.error = r.code
    return error_response(r.status, r.message, r.code, r.headers)


def _overloaded(model: str) -> web.Response:
    return error_response(
        503,
        f"every backend for model '{model}' is at its concurrency limit; retry shortly",
        "overloaded",
        {"retry-after": "1", "x-pulsegate-attempts": "0"},
    )


def _final_error(model: str, tried: list[str], last: Failure | None) -> tuple[web.Response, str]:
    """The answer when no attempt succeeded, and its error code."""
    headers = {"x-pulsegate-attempts": str(len(tried)), "retry-after": "1"}
    if last is None:
        code = "no_healthy_backend"
        return error_response(503, f"no healthy backend for model '{model}'", code, headers), code
    if last.outcome is Outcome.OVERLOADED:
        headers["retry-after"] = last.retry_after or "1"
        code = "overloaded"
        msg = f"every backend for model '{model}' is overloaded"
        return error_response(503, msg, code, headers), code
    status = 504 if last.outcome is Outcome.TIMEOUT else 502
    code = "upstream_failed"
    msg = f"all {len(tried)} attempt(s) for model '{model}' failed; last: {last.detail}"
    return error_response(status, msg, code, headers), code
