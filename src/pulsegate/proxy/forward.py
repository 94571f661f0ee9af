"""The proxy path: parse the few fields routing needs, pick, forward bytes, retry, report.

Per request this reads the body once, parses it once with orjson (only `model`, `stream`,
`max_tokens`, `user` are looked at), and forwards the original bytes unchanged. Retries are
only possible while nothing has reached the client: a non-streamed answer is buffered whole
before it is sent, a stream is committed at its first body chunk. Never the same backend
twice for one request; at most `retry.max_attempts` tries, and retries beyond the first
also need the retry budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from pulsegate import clock
from pulsegate import stall as loop_stall
from pulsegate.balancer import prefix_key
from pulsegate.health.observations import Outcome, RequestResult
from pulsegate.proxy.classify import classify_exception, classify_status, describe
from pulsegate.proxy.errors import error_body, error_response
from pulsegate.proxy.relay import Relay
from pulsegate.proxy.stops import cut_answer, stop_strings
from pulsegate.proxy.upstream import Response as UpstreamResponse
from pulsegate.proxy.upstream import UpstreamError
from pulsegate.proxy.validate import fewer_choices, invalid_field

if TYPE_CHECKING:
    from pulsegate.gateway import BackendRuntime, Gateway
    from pulsegate.health.verdict import Verdict

log = logging.getLogger("pulsegate.proxy")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Response headers from the backend that we pass on; everything else (hop-by-hop,
# server identity, content-length recomputed by aiohttp's server) is dropped.
_PASS_HEADERS = ("content-type", "content-encoding", "x-request-id", "retry-after")


_OK_NONSTREAM = RequestResult(Outcome.OK, None, 200)


@dataclass(slots=True)
class Failure:
    outcome: Outcome
    status: int | None
    detail: str
    retry_after: str | None = None
    # A client error from the backend is final: pass it on as it came.
    response: web.Response | None = None


class Forwarder:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        cfg = gw.config
        self.max_body = cfg.gateway.max_body_bytes
        self.max_attempts = cfg.retry.max_attempts
        self.per_try = cfg.retry.per_try_timeout
        self.per_token = cfg.retry.per_token_timeout
        self.request_timeout = cfg.retry.request_timeout
        self.prefix_chars = cfg.routing.prefix_affinity_chars
        self.queue_timeout = cfg.routing.queue_timeout
        # `resume: none`: an engine that cannot continue a stream is never a continuation
        # target, whatever engine the stream broke on.
        self.resume_unable = tuple(n for n, b in gw.backends.items() if b.resume == "none")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, COMPLETIONS)

    # -- request parsing ------------------------------------------------------------------

    async def handle(self, request: web.Request, path: str) -> web.StreamResponse:
        cl = request.content_length
        if cl is not None and cl > self.max_body:
            return _too_large(self.max_body)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large(self.max_body)
        if len(body) > self.max_body:
            return _too_large(self.max_body)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            return error_response(400, f"request body is not valid JSON: {e}", "invalid_json")
        if not isinstance(doc, dict):
            return error_response(400, "request body must be a JSON object", "invalid_request")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            return error_response(400, "'model' is required and must be a string", "missing_model")
        if path == CHAT:
            msgs = doc.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return error_response(
                    400, "'messages' is required and must be a non-empty list", "missing_messages"
                )
        elif "prompt" not in doc:
            return error_response(400, "'prompt' is required", "missing_prompt")
        why = invalid_field(doc, path == CHAT)
        if why is not None:
            return error_response(400, why, "invalid_request")
        avoid, why = fewer_choices(doc, model, self.gw.config.backends)
        if why is not None:
            return error_response(400, why, "invalid_request")
        stream = doc.get("stream") is True
        key = request.headers.get("x-session-id")
        if key is None:
            user = doc.get("user")
            key = user if isinstance(user, str) and user else None
            if key is None and self.prefix_chars:
                key = prefix_key(_prompt_head(doc, self.prefix_chars), self.prefix_chars)
        return await self.route(request, path, body, doc, model, stream, key, avoid)

    def _deadline(self, doc: dict[str, Any], stream: bool) -> float:
        """Seconds an attempt may wait for its first byte.

        A stream's first byte is its first token: `per_try_timeout`. A non-streamed answer
        arrives whole, so its first byte waits for the entire generation; allowing
        `per_token_timeout` per requested token keeps long legitimate generations from
        being cut (R17) while a hung backend is still left within seconds for short ones.
        """
        if stream:
            return self.per_try
        mt = doc.get("max_completion_tokens", doc.get("max_tokens"))
        tokens = mt if isinstance(mt, int) and mt > 0 else 1024
        return min(self.request_timeout, self.per_try + tokens * self.per_token)

    # -- routing and retries --------------------------------------------------------------

    async def route(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        doc: dict[str, Any],
        model: str,
        stream: bool,
        session_key: str | None,
        avoid: Sequence[str] = (),
    ) -> web.StreamResponse:
        """Try backends until one answers; never one in `avoid` (it cannot serve this
        request: `n` beyond its `max_n`)."""
        gw = self.gw
        now = clock.monotonic()
        gw.budget.deposit(now)
        if not gw.fleet.serves(model):
            return error_response(
                404, f"model '{model}' is not served by any backend", "model_not_found"
            )
        deadline = self._deadline(doc, stream)
        tried: list[str] = []
        last: Failure | None = None
        start = now
        while len(tried) < self.max_attempts:
            # Requests already queued for this model go first: a newcomer queues behind them.
            ahead = not tried and gw.queue_ahead(model)
            skip = [*tried, *avoid] if avoid else tried
            verdict = None if ahead else gw.pick(model, skip, session_key)
            if verdict is None and (ahead or gw.saturated(model, skip)):
                # Backends not yet tried are only at their concurrency limit: wait in the
                # bounded queue rather than bury a survivor (R24, R25), retries included.
                verdict = await gw.wait_for_capacity(model, session_key, self.queue_timeout, skip)
                if verdict is None:
                    return _overloaded(model)
            if verdict is None:
                break
            if tried:
                if not gw.budget.try_withdraw(clock.monotonic()):
                    gw.m_retries.inc(("budget_exhausted",))
                    break
                gw.m_retries.inc((last.outcome.value if last else "unknown",))
            tried.append(verdict.name)
            backend = gw.backends[verdict.name]
            result = await self._attempt(
                request, backend, path, body, doc, model, stream, deadline, tried, session_key
            )
            if not isinstance(result, Failure):
                gw.m_request_seconds.observe(clock.monotonic() - start)
                return result
            last = result
            gw.m_requests.inc((backend.name, model, str(result.status or result.outcome.value)))
            if result.response is not None:  # the request's own fault: no retry
                return result.response
        gw.m_request_seconds.observe(clock.monotonic() - start)
        return _final_error(model, tried, last)

    async def _attempt(
        self,
        request: web.Request,
        backend: BackendRuntime,
        path: str,
        body: bytes,
        doc: dict[str, Any],
        model: str,
        stream: bool,
        deadline: float,
        tried: list[str],
        session_key: str | None,
    ) -> web.StreamResponse | Failure:
        gw = self.gw
        name = backend.name
        gw.acquire(name)
        handed_off = False
        try:
            opened = await self._open(backend, path, body, stream, deadline)
            if isinstance(opened, Failure):
                return opened
            resp, data, status = opened
            headers = _response_headers(resp, name, len(tried))
            if not stream:
                stops = stop_strings(doc)
                if stops and status == 200:
                    data = cut_answer(data, stops)
                gw.m_requests.inc((name, model, str(status)))
                return web.Response(status=status, body=data, headers=headers)
            handed_off = True
            relay = Relay(self, request, doc, path, model, tried, session_key)
            return await relay.run(backend, resp, data, headers)
        finally:
            if not handed_off:
                gw.release(name)

    async def _open(
        self, backend: BackendRuntime, path: str, body: bytes, stream: bool, deadline: float
    ) -> tuple[UpstreamResponse, bytes, int] | Failure:
        """Send the request and wait for its first byte: a stream's first chunk, or a
        non-streamed answer whole. Reports the outcome to the health core."""
        gw = self.gw
        name = backend.name
        t0 = clock.monotonic()
        token = gw.watch_first_byte(name, t0) if stream else None
        got_headers = False
        resp: UpstreamResponse | None = None
        pool = gw.upstream.pool(name, backend.url, backend.headers)
        try:
            async with asyncio.timeout(deadline) as cm:
                # Registered so an ejection of this backend cuts the wait at once: nothing
                # has reached the client yet, so the request just moves on.
                gw.watch_pending(name, cm)
                resp = await pool.post(path, body)
                got_headers = True
                if resp.status >= 400:
                    gw.unwatch_pending(name, cm)  # it reports (and may eject) itself
                    return await self._upstream_error(backend, resp, t0)
                if stream:
                    data = await resp.read_chunk()
                else:
                    data = await resp.read()
                    resp.release()
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()  # the client left: never leave a half-read connection behind
            raise
        except (UpstreamError, OSError, TimeoutError) as e:
            outcome = classify_exception(e, got_headers)
            if resp is not None:
                resp.close()
            # Unwatched before reporting: the report may eject this backend, and the cut of
            # its pending attempts must not reach this one, which is already done.
            gw.unwatch_pending(name, cm)
            if isinstance(e, TimeoutError) and _own_stall(t0, deadline):
                # Our own loop stood still for part of the wait: the attempt moves on, but
                # the backend is not blamed for time we were not running (pulsegate.stall).
                return Failure(outcome, None, f"{name}: {describe(e)} (gateway stalled)")
            gw.report(name, RequestResult(outcome, None, None))
            return Failure(outcome, None, f"{name}: {describe(e)}")
        finally:
            gw.unwatch_pending(name, cm)
            if token is not None:
                gw.first_byte_seen(name, token)
        ttft = clock.monotonic() - t0
        # A non-streamed answer arrives whole: its time is generation time, not time to
        # first token, and must not look like latency to the health core (R17).
        if stream:
            gw.report(name, RequestResult(Outcome.OK, ttft, resp.status))
            gw.m_ttft.observe(ttft)
        else:
            gw.report(name, _OK_NONSTREAM)
        return resp, data, resp.status

    def pick_continuation(
        self, model: str, tried: Sequence[str], session_key: str | None
    ) -> Verdict | None:
        """The backend a broken stream would continue on now: not tried yet for this request
        and able to continue a stream."""
        return self.gw.pick(model, [*tried, *self.resume_unable], session_key)

    async def reopen(
        self,
        path: str,
        build: Callable[[BackendRuntime], Awaitable[bytes | None]],
        model: str,
        tried: list[str],
        session_key: str | None,
    ) -> tuple[BackendRuntime, UpstreamResponse, bytes] | Failure | None:
        """Open a continuation stream on a backend not yet tried for this request, with the
        body `build(backend)` makes for it (None from `build`: nothing to continue, and
        reopen returns None).

        On success the backend is acquired (in flight) and the caller must release it."""
        gw = self.gw
        last: Failure | None = None
        for _ in range(self.max_attempts):
            verdict = self.pick_continuation(model, tried, session_key)
            if verdict is None:
                break
            backend = gw.backends[verdict.name]
            tried.append(backend.name)
            gw.acquire(backend.name)
            body = await build(backend)
            if body is None:
                gw.release(backend.name)
                return None
            opened = await self._open(backend, path, body, True, self.per_try)
            if isinstance(opened, Failure):
                gw.release(backend.name)
                last = opened
                continue
            return backend, opened[0], opened[1]
        return last

    async def _upstream_error(
        self, backend: BackendRuntime, resp: UpstreamResponse, t0: float
    ) -> Failure:
        status = resp.status
        retry_after = resp.headers.get("retry-after")
        outcome = classify_status(status, retry_after is not None)
        try:
            data = await resp.read()
        finally:
            resp.release()
        self.gw.report(backend.name, RequestResult(outcome, clock.monotonic() - t0, status))
        if outcome is Outcome.CLIENT_ERROR:
            status, data = normalize_error(status, data)
            headers = {"content-type": "application/json", "x-pulsegate-backend": backend.name}
            return Failure(
                outcome,
                status,
                "client error",
                response=web.Response(status=status, body=data, headers=headers),
            )
        return Failure(outcome, status, f"{backend.name}: HTTP {status}", retry_after)


def _response_headers(resp: UpstreamResponse, name: str, attempts: int) -> dict[str, str]:
    h = {"x-pulsegate-backend": name, "x-pulsegate-attempts": str(attempts)}
    rh = resp.headers
    for k in _PASS_HEADERS:
        v = rh.get(k)
        if v is not None:
            h[k] = v
    return h


def normalize_error(status: int, body: bytes) -> tuple[int, bytes]:
    """A backend's 4xx in OpenAI's shape: an `{"error": {...}}` body passes unchanged;
    FastAPI's `{"detail": ...}` or plain text is wrapped; 422 (FastAPI validation) is 400."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return status, body
    if isinstance(doc, dict) and "detail" in doc:
        detail = doc["detail"]
        message = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
    else:
        message = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    if status == 422:
        status = 400
    code = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found"}
    return status, error_body(status, message, code.get(status, "upstream_client_error"))


def _prompt_head(doc: dict[str, Any], k: int) -> str:
    """The first k characters of the prompt (system prompt + first turn) for prefix affinity."""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return prompt[:k]
    parts: list[str] = []
    n = 0
    for m in doc.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(c)
            n += len(c)
            if n >= k:
                break
    return "".join(parts)[:k]


def _overloaded(model: str) -> web.Response:
    return error_response(
        503,
        f"every backend for model '{model}' is at its concurrency limit; retry shortly",
        "overloaded",
        {"retry-after": "1", "x-pulsegate-attempts": "0"},
    )


def _too_large(limit: int) -> web.Response:
    return error_response(413, f"request body exceeds the {limit}-byte limit", "request_too_large")


def _final_error(model: str, tried: list[str], last: Failure | None) -> web.Response:
    headers = {"x-pulsegate-attempts": str(len(tried)), "retry-after": "1"}
    if last is None:
        return error_response(
            503, f"no healthy backend for model '{model}'", "no_healthy_backend", headers
        )
    if last.outcome is Outcome.OVERLOADED:
        headers["retry-after"] = last.retry_after or "1"
        return error_response(
            503, f"every backend for model '{model}' is overloaded", "overloaded", headers
        )
    status = 504 if last.outcome is Outcome.TIMEOUT else 502
    return error_response(
        status,
        f"all {len(tried)} attempt(s) for model '{model}' failed; last: {last.detail}",
        "upstream_failed",
        headers,
    )


def _own_stall(t0: float, deadline: float) -> bool:
    """The deadline since `t0` ran out only because this process's loop was stalled."""
    now = clock.monotonic()
    excused = loop_stall.watch().excuse(t0, now)
    return excused > 0.0 and now - t0 - excused < deadline
