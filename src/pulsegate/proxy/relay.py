"""The stream relay: one client stream, one or more upstreams, exactly one `[DONE]`.

`Relay.run` forwards the first upstream's events unchanged, watches it with a stall
watchdog, and when it breaks continues on another backend (see `stream.py` for how the
continuation is built). A client disconnect cancels the handler (aiohttp's handler
cancellation), which closes the upstream in `finally`: no orphaned generation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from pulsegate import stall as loop_stall
from pulsegate.health.observations import FirstByteOverdue, Outcome, RequestResult
from pulsegate.proxy.classify import describe
from pulsegate.proxy.errors import sse_error_event
from pulsegate.proxy.sse import Event as SSEEvent
from pulsegate.proxy.sse import SSEParser
from pulsegate.proxy.stops import StopFilter, stop_strings
from pulsegate.proxy.stream import (
    StreamState,
    finish_chunk,
    remaining_tokens,
    resume_body,
    resume_refusal,
    rewrite,
    token_count,
    tokenize_request,
    track,
)
from pulsegate.proxy.upstream import Response as UpstreamResponse
from pulsegate.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from pulsegate.gateway import BackendRuntime
    from pulsegate.proxy.forward import Forwarder

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_GO_ON = ""  # `Relay._relay`: the upstream may send more (a reason why it broke is never "")
_DONE = b"data: [DONE]\n\n"
# Once its backend is ejected, a stream idle this long is cut and resumed elsewhere.
EJECTED_STALL_S = 0.25
# Counting the sent text's tokens on the continuation target: ~1-50 ms for vLLM; past this
# the event count is used rather than delay the resume further.
TOKENIZE_TIMEOUT_S = 2.0


class Closable(Protocol):
    """What the watchdog needs of an upstream response: closing it wakes the pending read."""

    def close(self) -> None: ...


class Watchdog:
    """Closes the upstream when no bytes arrived for `stall` seconds - if the stream can go on.

    A cut stream is continued on another backend; with none to continue on (the only engine
    left is slow, or the request cannot be resumed), a cut turns a slow stream into a client
    error. So the cut happens only when `may_cut()` says a continuation can be had, or once
    `deadline` (loop time: the request's own `retry.request_timeout`) has passed; otherwise
    the stream keeps waiting and the check repeats every `stall` seconds.

    One timer per stall period rather than one per chunk: `touch()` only stores a time."""

    __slots__ = (
        "_deadline",
        "_handle",
        "_hint",
        "_loop",
        "_may_cut",
        "_resp",
        "last",
        "reason",
        "stall",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        resp: Closable,
        stall: float,
        may_cut: Callable[[], bool] | None = None,
        deadline: float = math.inf,
    ) -> None:
        self._loop = loop
        self._resp = resp
        self.stall = stall
        self._may_cut = may_cut
        self._deadline = deadline
        self.last = loop.time()
        self.reason: str | None = None
        self._hint = "stalled"
        self._handle: asyncio.Handle | None = loop.call_later(stall, self._check)

    def touch(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        now = self._loop.time()
        idle = now - self.last
        if idle >= self.stall:
            # Time our own loop stood still is not the engine's silence: its tokens may be
            # sitting unread (pulsegate.stall).
            idle = loop_stall.running(self.last, now)
        if idle < self.stall:
            self._handle = self._loop.call_later(
                max(self.stall - idle, loop_stall.RECHECK_S), self._check
            )
        elif self._may_cut is None or self._may_cut():
            self.cut(f"{self._hint}: no token for {idle * 1000:.0f}ms")
        elif now >= self._deadline:
            self.cut(f"{self._hint}: no token for {idle * 1000:.0f}ms, request deadline reached")
        else:
            # Nowhere to continue: keep waiting for the slow stream, within the deadline.
            wait = min(self.stall, max(0.0, self._deadline - now))
            self._handle = self._loop.call_later(wait, self._check)

    def tighten(self, stall: float, reason: str) -> None:
        """The backend was ejected: cut the stream if it idles `stall` seconds, whether or
        not it can be continued elsewhere. The health core judged the engine sick: an idle
        stream on it is not "slow but alive", and must not hold its client until the
        request's deadline (minutes) for want of another backend."""
        self._hint = reason
        self._may_cut = None
        if stall < self.stall and self.reason is None:
            self.stall = stall
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_soon(self._check)

    def cut(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop()
        self._resp.close()  # wakes the pending read with ClientConnectionError

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Relay:
    def __init__(
        self,
        fwd: Forwarder,
        request: web.Request,
        doc: dict[str, Any],
        path: str,
        model: str,
        tried: list[str],
        session_key: str | None,
    ) -> None:
        self.fwd = fwd
        self.gw = fwd.gw
        self.request = request
        self.doc = doc
        self.path = path
        self.model = model
        self.tried = tried
        self.session_key = session_key
        so = doc.get("stream_options")
        self.include_usage = isinstance(so, dict) and so.get("include_usage") is True
        self.continuous_usage = isinstance(so, dict) and so.get("continuous_usage_stats") is True
        cfg = self.gw.config.streaming
        self.resume_enabled = cfg.resume
        self.max_resumes = cfg.max_resumes
        self.stall = cfg.stall_timeout
        self.state = StreamState()
        stops = stop_strings(doc)
        self.stops = StopFilter(stops) if stops else None
        self.resumes = 0
        # A stalled stream with nowhere to continue waits at most until then (loop time).
        self.deadline = asyncio.get_running_loop().time() + fwd.request_timeout

    async def run(
        self,
        backend: BackendRuntime,
        resp: UpstreamResponse,
        first: bytes,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Relay `resp` (whose first chunk is `first`) and any continuations. The caller
        acquired `backend`; the relay releases every backend it used."""
        gw = self.gw
        out = self._out = web.StreamResponse(status=resp.status, headers=headers)
        out.headers.update(_SSE_HEADERS)
        held: str | None = backend.name  # the backend acquired (in flight) right now
        try:
            await out.prepare(self.request)
            while True:
                broken = await self._pump(out, backend, resp, first, rewriting=self.resumes > 0)
                resp.close()
                if broken is None:
                    gw.m_requests.inc((backend.name, self.model, str(resp.status)))
                    await out.write_eof()
                    return out
                if broken.startswith("stalled"):
                    # Our own watchdog cut a quiet stream: suspect evidence (new requests go
                    # elsewhere, probes speed up), not a hard failure. A busy but healthy
                    # engine must not be ejected by five slow streams (R17, R21).
                    gw.report(backend.name, FirstByteOverdue(1, self.stall))
                elif not broken.startswith(("backend ejected", "the gateway is shutting")):
                    gw.report(backend.name, RequestResult(Outcome.STREAM_BROKEN, None, None))
                gw.m_requests.inc((backend.name, self.model, "stream_broken"))
                gw.release(backend.name)
                held = None
                refusal = self._refusal()
                if refusal is not None:
                    await self._end_with_error(f"stream from {backend.name} {broken}; {refusal}")
                    return out
                if self._all_sent():
                    await self._finish()
                    return out
                # The continuation target counts the tokens already sent (`_continuation`).
                opened = await self.fwd.reopen(
                    self.path, self._continuation, self.model, self.tried, self.session_key
                )
                if not isinstance(opened, tuple):
                    if self._all_sent():  # counted exactly on the target: nothing is missing
                        await self._finish()
                        return out
                    why = opened.detail if opened is not None else "no healthy backend left"
                    await self._end_with_error(
                        f"stream from {backend.name} {broken}; resume failed: {why}"
                    )
                    return out
                backend, resp, first = opened
                held = backend.name
                self.resumes += 1
                gw.m_resumes.inc()
        finally:
            resp.close()
            if held is not None:
                gw.release(held)

    def _refusal(self) -> str | None:
        """Why this stream must not be continued elsewhere now, or None."""
        if self.state.done:
            return "after [DONE]"
        if self.gw.shutting_down:
            return "the gateway is shutting down"
        if not self.resume_enabled:
            return "stream resume is disabled"
        if self.resumes >= self.max_resumes:
            return f"already resumed {self.resumes} time(s)"
        return resume_refusal(self.doc, self.state)

    def _watchdog(self, resp: Closable) -> Watchdog:
        return Watchdog(asyncio.get_running_loop(), resp, self.stall, self._may_cut, self.deadline)

    def _may_cut(self) -> bool:
        """A stall is cut only when the stream could be continued elsewhere right now: with
        no backend to go on, a cut makes a slow but alive stream a client error (the only
        engine left on a starved box, docs/real-engines.md finding 6)."""
        if self._refusal() is not None:
            return False
        return self.fwd.pick_continuation(self.model, self.tried, self.session_key) is not None

    def _all_sent(self) -> bool:
        left = remaining_tokens(self.doc, self.state)
        return left is not None and left <= 0

    async def _finish(self) -> None:
        """Every requested token reached the client: only the ending was lost."""
        out = self._out
        await out.write(finish_chunk(self.state, self.path))
        await out.write(_DONE)
        await out.write_eof()

    async def _continuation(self, target: BackendRuntime) -> bytes | None:
        """The request continuing this stream on `target`; None when every requested token
        has already reached the client.

        The tokens sent are counted on `target` (`POST /tokenize`, vLLM's) when it answers:
        engines merge several tokens into one event when their API loop lags (vLLM: 200
        tokens in 135-202 events, up to 19 in one), so the event count undercounts, and the
        continuation would be asked for too many tokens (803 for `max_tokens` 800) and the
        merged usage would be wrong. Without `/tokenize` the event count stands."""
        state = self.state
        counted = await self._count_tokens(target, state.sent_text(0))
        if counted is not None:
            state.tokens = counted
        if self._all_sent():
            return None
        state.tokens_before = state.tokens
        return resume_body(self.doc, self.path, state)

    async def _count_tokens(self, target: BackendRuntime, text: str) -> int | None:
        """Tokens in `text` by `target`'s tokenizer, or None when it cannot tell us."""
        if not text:
            return 0
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                r = await self.gw.session.post(
                    target.url + "/tokenize",
                    data=tokenize_request(self.model, text),
                    headers=target.headers,
                )
                try:
                    return token_count(await r.read()) if r.status == 200 else None
                finally:
                    r.release()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def _pump(
        self,
        out: web.StreamResponse,
        backend: BackendRuntime,
        resp: UpstreamResponse,
        chunk: bytes,
        rewriting: bool,
    ) -> str | None:
        """Forward one upstream until `[DONE]` (returns None) or it breaks (returns why).

        What one upstream read completes goes to the client in one write (one chunked frame,
        one send) after all its events were looked at: engines that batch tokens under
        load cost one write per batch, not one per token."""
        gw = self.gw
        state = self.state
        parser = SSEParser()
        watch = self._watchdog(resp)
        gw.watch_stream(backend.name, watch)
        parts: list[bytes] = []
        try:
            while True:
                why = self._relay(parser.feed(chunk), parts, rewriting)
                if parts:
                    await out.write(parts[0] if len(parts) == 1 else b"".join(parts))
                    parts.clear()
                if why is not _GO_ON:
                    if why is None:
                        resp.release()  # the connection may serve the next request
                    return why
                try:
                    chunk = await resp.read_chunk()
                except (UpstreamError, OSError) as e:
                    return watch.reason or f"failed: {describe(e)}"
                if not chunk:
                    if state.finished:
                        # Some engines (transformers serve) never send [DONE]: the
                        # generation is complete, so end it the OpenAI way.
                        state.done = True
                        await out.write(_DONE)
                        return None
                    return watch.reason or "ended without [DONE]"
                watch.touch()
        finally:
            watch.stop()
            gw.unwatch_stream(backend.name, watch)

    def _relay(self, events: list[SSEEvent], parts: list[bytes], rewriting: bool) -> str | None:
        """Append to `parts` what the client gets of `events`; returns None after `[DONE]`,
        why when the upstream sent something broken, else `_GO_ON`."""
        state = self.state
        for ev in events:
            data = ev.data
            if data is None:
                if not rewriting:
                    parts.append(ev.raw)  # comments / keep-alives
                continue
            if data == b"[DONE]":
                state.done = True
                parts.append(ev.raw if not rewriting else _DONE)
                return None
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                return "sent a malformed event"
            if not isinstance(obj, dict):
                return "sent a malformed event"
            if rewriting:
                b = rewrite(state, obj, self.include_usage)
                if b is not None:
                    parts.append(b)
                continue
            raw = ev.raw
            if self.stops is not None:
                filtered = self.stops.feed(obj)
                if filtered is None:
                    continue
                # The filter edits the chunk in place (held back or cut text): re-made.
                obj, raw = filtered, b"data: " + orjson.dumps(filtered) + b"\n\n"
            track(state, obj)
            if obj.get("usage") is not None and not self.continuous_usage:
                self._usage_openai_way(obj, raw, parts)
            else:
                parts.append(raw)  # the pass-through path: the backend's bytes, unchanged
        return _GO_ON

    def _usage_openai_way(self, obj: dict[str, Any], raw: bytes, parts: list[bytes]) -> None:
        """`usage` only when asked, in its own chunk with `choices: []` (OpenAI, vLLM).
        Some engines (transformers serve) always put it on the last content chunk."""
        usage = obj["usage"]
        if not obj.get("choices"):
            if self.include_usage:
                parts.append(raw)  # already the OpenAI way
            return
        del obj["usage"]
        parts.append(b"data: " + orjson.dumps(obj) + b"\n\n")
        if self.include_usage:
            extra = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
            parts.append(b"data: " + orjson.dumps({**extra, "choices": [], "usage": usage}))
            parts.append(b"\n\n")

    async def _end_with_error(self, message: str) -> None:
        out = self._out
        try:
            await out.write(sse_error_event(502, message, "upstream_stream_broken"))
            await out.write(_DONE)
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass
