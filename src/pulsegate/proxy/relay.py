"""The stream relay: one client stream, one or more upstreams, exactly one `[DONE]`.

`Relay.run` forwards the first upstream's events unchanged, watches it with a stall
watchdog, and when it breaks continues on another backend (see `stream.py` for how the
continuation is built). A client disconnect cancels the handler (aiohttp's handler
cancellation), which closes the upstream in `finally`: no orphaned generation.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

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
    track,
)

if TYPE_CHECKING:
    from pulsegate.gateway import BackendRuntime
    from pulsegate.proxy.forward import Forwarder

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"
# Once its backend is ejected, a stream idle this long is cut and resumed elsewhere.
EJECTED_STALL_S = 0.25


class Watchdog:
    """Closes the upstream when no bytes arrived for `stall` seconds.

    One timer per stall period rather than one per chunk: `touch()` only stores a time."""

    __slots__ = ("_handle", "_hint", "_loop", "_resp", "last", "reason", "stall")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, resp: aiohttp.ClientResponse, stall: float
    ) -> None:
        self._loop = loop
        self._resp = resp
        self.stall = stall
        self.last = loop.time()
        self.reason: str | None = None
        self._hint = "stalled"
        self._handle: asyncio.Handle | None = loop.call_later(stall, self._check)

    def touch(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        idle = self._loop.time() - self.last
        if idle >= self.stall:
            self.cut(f"{self._hint}: no token for {idle * 1000:.0f}ms")
        else:
            self._handle = self._loop.call_later(self.stall - idle, self._check)

    def tighten(self, stall: float, reason: str) -> None:
        """The backend was ejected: cut the stream if it idles `stall` seconds."""
        self._hint = reason
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

    async def run(
        self,
        backend: BackendRuntime,
        resp: aiohttp.ClientResponse,
        first: bytes,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Relay `resp` (whose first chunk is `first`) and any continuations. The caller
        acquired `backend`; the relay releases every backend it used."""
        gw = self.gw
        out = self._out = web.StreamResponse(status=resp.status, headers=headers)
        out.headers.update(_SSE_HEADERS)
        resumes = 0
        held: str | None = backend.name  # the backend acquired (in flight) right now
        try:
            await out.prepare(self.request)
            while True:
                broken = await self._pump(out, backend, resp, first, rewriting=resumes > 0)
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
                refusal = self._refusal(broken, backend, resumes)
                if refusal is not None:
                    await self._end_with_error(f"stream from {backend.name} {broken}; {refusal}")
                    return out
                left = remaining_tokens(self.doc, self.state)
                if left is not None and left <= 0:
                    # Every requested token reached the client: only the ending was lost.
                    await out.write(finish_chunk(self.state, self.path))
                    await out.write(_DONE)
                    await out.write_eof()
                    return out
                self.state.tokens_before = self.state.tokens
                body = resume_body(self.doc, self.path, self.state)
                opened = await self.fwd.reopen(
                    self.path, body, self.model, self.tried, self.session_key
                )
                if opened is None or not isinstance(opened, tuple):
                    why = opened.detail if opened is not None else "no healthy backend left"
                    await self._end_with_error(
                        f"stream from {backend.name} {broken}; resume failed: {why}"
                    )
                    return out
                backend, resp, first = opened
                held = backend.name
                resumes += 1
                gw.m_resumes.inc()
        finally:
            resp.close()
            if held is not None:
                gw.release(held)

    def _refusal(self, broken: str, backend: BackendRuntime, resumes: int) -> str | None:
        if self.state.done:
            return "after [DONE]"
        if self.gw.shutting_down:
            return "the gateway is shutting down"
        if not self.resume_enabled:
            return "stream resume is disabled"
        if resumes >= self.max_resumes:
            return f"already resumed {resumes} time(s)"
        return resume_refusal(self.doc, self.state)

    async def _pump(
        self,
        out: web.StreamResponse,
        backend: BackendRuntime,
        resp: aiohttp.ClientResponse,
        chunk: bytes,
        rewriting: bool,
    ) -> str | None:
        """Forward one upstream until `[DONE]` (returns None) or it breaks (returns why)."""
        gw = self.gw
        state = self.state
        parser = SSEParser()
        watch = Watchdog(asyncio.get_running_loop(), resp, self.stall)
        gw.watch_stream(backend.name, watch)
        try:
            while True:
                for ev in parser.feed(chunk):
                    data = ev.data
                    if data is None:
                        if not rewriting:
                            await out.write(ev.raw)  # comments / keep-alives
                        continue
                    if data == b"[DONE]":
                        state.done = True
                        await out.write(ev.raw if not rewriting else _DONE)
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
                            await out.write(b)
                    else:
                        if self.stops is not None:
                            filtered = self.stops.feed(obj)
                            if filtered is None:
                                continue
                            obj, ev = (
                                filtered,
                                SSEEvent(b"data: " + orjson.dumps(filtered) + b"\n\n", None),
                            )
                        track(state, obj)
                        if obj.get("usage") is not None and not self.continuous_usage:
                            await self._write_usage_openai_way(out, obj, ev.raw)
                        else:
                            await out.write(ev.raw)
                try:
                    chunk = await resp.content.readany()
                except (aiohttp.ClientError, OSError) as e:
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

    async def _write_usage_openai_way(
        self, out: web.StreamResponse, obj: dict[str, Any], raw: bytes
    ) -> None:
        """`usage` only when asked, in its own chunk with `choices: []` (OpenAI, vLLM).
        Some engines (transformers serve) always put it on the last content chunk."""
        usage = obj["usage"]
        if not obj.get("choices"):
            if self.include_usage:
                await out.write(raw)  # already the OpenAI way
            return
        del obj["usage"]
        await out.write(b"data: " + orjson.dumps(obj) + b"\n\n")
        if self.include_usage:
            extra = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
            await out.write(b"data: " + orjson.dumps({**extra, "choices": [], "usage": usage}))
            await out.write(b"\n\n")

    async def _end_with_error(self, message: str) -> None:
        out = self._out
        try:
            await out.write(sse_error_event(502, message, "upstream_stream_broken"))
            await out.write(_DONE)
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass
