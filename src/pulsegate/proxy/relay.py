"""The stream relay: one client stream, one or more upstreams, exactly one `[DONE]`.

`Relay.run` forwards the first upstream's events unchanged, watches it with a stall
watchdog (`watchdog.py`), and when it breaks continues on another backend (see `resume.py`
for how the continuation is built): it asks its continuation-target callable for a backend
and opens it with the attempt opener, the same one every first attempt uses. A client
disconnect cancels the handler (either server's handler cancellation), which closes the
upstream in `finally`: no orphaned generation. The client's side is a `StreamOut`
(`client_out.py`), the lean server's or aiohttp's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from pulsegate.clock import Clock
from pulsegate.health.observations import FirstByteOverdue, Outcome, RequestResult
from pulsegate.proxy.attempt import AttemptOpener, Failure, Opened
from pulsegate.proxy.classify import describe
from pulsegate.proxy.client_out import Incoming, StreamOut
from pulsegate.proxy.cuts import MALFORMED, NO_DONE, Cut, Evidence, failed
from pulsegate.proxy.dialects import TYPED, Dialect, for_api
from pulsegate.proxy.dialects.base import Continuation
from pulsegate.proxy.dialects.chat import rewrite, track
from pulsegate.proxy.dialects.token_ids import Ids
from pulsegate.proxy.exchange import Exchange
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.pipe import GO_ON, Framing, Pipe
from pulsegate.proxy.ports import Outcomes
from pulsegate.proxy.request import ProxyRequest
from pulsegate.proxy.sse import Event as SSEEvent
from pulsegate.proxy.sse import plain_sse as _plain_sse
from pulsegate.proxy.state import ProxyState
from pulsegate.proxy.stops import StopFilter
from pulsegate.proxy.targets import Target
from pulsegate.proxy.upstream import Response as UpstreamResponse
from pulsegate.proxy.upstream import UpstreamError
from pulsegate.proxy.watchdog import Closable, Watchdog

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"

# Where a broken stream would continue now (a backend not tried yet), or None.
ContinuationTarget = Callable[[Sequence[str]], Target | None]


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """What the relay needs of the config, computed once."""

    resume: bool
    max_resumes: int
    stall: float  # streaming.stall_timeout
    per_try: float  # a continuation's wait for its first token
    request_timeout: float
    max_attempts: int  # continuation targets tried per resume
    resume_unable: tuple[str, ...]  # backends with `resume: none`
    # The stall rule's rhythm (`rhythm.py`): streaming.stall_floor, stall_factor (0: off).
    stall_floor: float = 0.15
    stall_factor: float = 4.0
    queue_timeout: float = 2.0  # routing.queue_timeout: a continuation's wait for a slot


class Relay:
    def __init__(
        self,
        request: Incoming,
        req: ProxyRequest,
        ex: Exchange,
        settings: StreamSettings,
        state: ProxyState,
        opener: AttemptOpener,
        continuation_target: ContinuationTarget,
        targets: Mapping[str, Target],
        outcomes: Outcomes,
        metrics: ProxyMetrics,
        clock: Clock,
        learn: Callable[[str], None] | None = None,  # told the Responses id the client sees
    ) -> None:
        self.request = request
        self.req = req
        self.doc = req.doc
        self.ex = ex
        self.tried = ex.backends
        self.settings = settings
        self.proxy = state
        self.opener = opener
        self.continuation_target = continuation_target
        self.targets = targets
        self.outcomes = outcomes
        self.metrics = metrics
        self.clock = clock
        so = self.doc.get("stream_options")
        self.include_usage = isinstance(so, dict) and so.get("include_usage") is True
        self.continuous_usage = isinstance(so, dict) and so.get("continuous_usage_stats") is True
        # The API's framing, once per stream: chat chunks, or typed events (`_relay_typed`).
        self.dialect: Dialect = for_api(req.api, req.path, self.doc, learn)
        self.typed = req.api in TYPED
        self.state = self.dialect.state
        self.stops = StopFilter(req.stops) if req.stops else None
        self.resumes = 0
        self.ids: Ids | None = None  # a vLLM stream's token ids (`dialects/token_ids.py`)
        self.exact: Ids | None = None  # ... when the continuation now goes on from them
        # A stalled stream with nowhere to continue waits at most until then.
        self.deadline = clock.now() + settings.request_timeout

    async def run(self, opened: Opened, headers: dict[str, str]) -> StreamOut:
        """Relay `opened` and any continuations. The caller acquired its backend; the relay
        releases every backend it used."""
        target, resp, first = opened.target, opened.resp, opened.first
        self.ids = Ids.of(self.req, target, self.settings.resume)
        headers.update(_SSE_HEADERS)
        # Draining: `Connection: close`, the client reconnects elsewhere.
        out = self._out = self.request.stream_out(resp.status, headers, self.proxy.shutting_down)
        try:
            await self._relay_all(out, target, resp, first)
            return out
        finally:
            ex = self.ex
            ex.resumes = self.resumes
            if ex.tokens_out is None or ex.tokens_out < self.state.tokens:
                ex.tokens_out = self.state.tokens
            end = self.clock.now()
            for a in ex.attempts:
                if not a.end:
                    a.end = end

    async def _relay_all(
        self, out: StreamOut, target: Target, resp: UpstreamResponse, first: bytes
    ) -> None:
        proxy, metrics, model = self.proxy, self.metrics, self.req.model
        held: str | None = target.name  # the backend acquired (in flight) right now
        try:
            await out.start()
            while True:
                cut = await self._pump(out, target, resp, first, rewriting=self.resumes > 0)
                resp.close()
                if cut is None:
                    metrics.requests.inc((target.name, model, str(resp.status)))
                    await out.end()
                    return
                _blame(self.outcomes, self.settings.stall, target.name, cut)
                broken = self.ex.attempts[-1]
                broken.end, broken.outcome = self.clock.now(), "stream_broken"
                metrics.requests.inc((target.name, model, "stream_broken"))
                proxy.release(target.name)
                held = None
                if self.dialect.ended() and not self.state.done:
                    await self._finish()  # a typed stream broke after its generation ended
                    return
                refusal = self._refusal()
                if refusal is not None:
                    await self._end_with_error(f"stream from {target.name} {cut}; {refusal}")
                    return
                if self.all_sent():
                    await self._finish()
                    return
                reopened = await self._reopen()
                if not isinstance(reopened, Opened):
                    if self.all_sent():  # counted exactly on the target: nothing is missing
                        await self._finish()
                        return
                    why = reopened.detail if reopened is not None else "no healthy backend left"
                    await self._end_with_error(
                        f"stream from {target.name} {cut}; resume failed: {why}"
                    )
                    return
                target, resp, first = reopened.target, reopened.resp, reopened.first
                held = target.name
                self.resumes += 1
                metrics.resumes.inc()
        finally:
            resp.close()
            if held is not None:
                proxy.release(held)

    async def _reopen(self) -> Opened | Failure | None:
        """Open a continuation on a backend not yet tried for this request; None: there is
        none, or every requested token has already reached the client. On success the
        backend is acquired (in flight)."""
        proxy = self.proxy
        last: Failure | None = None
        for _ in range(self.settings.max_attempts):
            target = self.continuation_target(self.tried)
            if target is None:  # those left at their max_inflight: wait at the queue's head
                target = await proxy.wait_for_continuation(
                    self.req.model, self.tried, self.settings.queue_timeout,
                    lambda: self.continuation_target(self.tried),
                )  # fmt: skip
            if target is None:
                break
            self.tried.append(target.name)
            at = self.ex.attempt(target.name, self.clock.now(), resume=True)
            proxy.acquire(target.name)
            cont = await _continuation(self, target)
            if cont is None:
                proxy.release(target.name)
                return None
            path = cont.path or self.req.path
            opened = await self.opener.open(
                target, path, cont.body, True, self.settings.per_try, self.ex
            )
            if isinstance(opened, Failure):
                proxy.release(target.name)
                at.end = self.clock.now()
                at.status, at.outcome = opened.status, opened.outcome.value
                last = opened
                continue
            at.status, at.outcome = opened.resp.status, "ok"
            return opened
        return last

    def _refusal(self) -> str | None:
        """Why this stream must not be continued elsewhere now, or None."""
        if self.state.done:
            return "after [DONE]"
        if self.proxy.shutting_down:
            return "the gateway is shutting down"
        s = self.settings
        if not s.resume:
            return "stream resume is disabled"
        if self.resumes >= s.max_resumes:
            return f"already resumed {self.resumes} time(s)"
        return self.dialect.refusal(self.doc)

    def may_cut(self) -> bool:
        """A stall is cut only when the stream could be continued elsewhere right now: with
        no backend to go on, a cut makes a slow but alive stream a client error (the only
        engine left on a starved box, docs/real-engines.md finding 6)."""
        if self._refusal() is not None:
            return False
        return self.continuation_target(self.tried) is not None

    def all_sent(self) -> bool:
        """Every token the client asked for has reached it."""
        left = self.dialect.remaining(self.doc)
        return left is not None and left <= 0

    async def _finish(self) -> None:
        """Every requested token reached the client: only the ending was lost."""
        await self._out.send(self.dialect.finish())
        await self._out.end()

    async def _pump(
        self,
        out: StreamOut,
        target: Target,
        resp: UpstreamResponse,
        chunk: bytes,
        rewriting: bool,
    ) -> Cut | None:
        """Forward one upstream until `[DONE]` (returns None) or it breaks (returns why).

        The bytes go through `pipe.py` in the upstream's callback; this wakes only when the
        pipe stops (an end, a cut, a client that is behind) or the upstream ends or fails."""
        proxy = self.proxy
        state = self.state
        client = out
        watch = _watchdog(self, target.name, resp)
        proxy.watch_stream(target.name, watch)
        pipe = Pipe(client, watch, state, _framing(self, rewriting))
        try:
            why = pipe.relay(chunk)
            while True:
                if why is not GO_ON:
                    if why is None:
                        resp.release()  # the connection may serve the next request
                    return why
                if client.busy:
                    watch.holding = True  # a slow client's time is not the engine's
                    await client.drain()
                    watch.holding = False
                    watch.touch(state.tokens)
                resp.sink(pipe.take)
                await resp.sinking()
                resp.unsink()
                if pipe.error is not None:
                    raise pipe.error  # the client went away mid-write
                why = pipe.why
                if why is not GO_ON or client.busy:
                    continue
                try:  # the pipe still open: the upstream ended or failed
                    chunk = await resp.read_chunk()
                except (UpstreamError, OSError) as e:
                    return watch.cut_by or failed(describe(e))
                if chunk:
                    watch.beat()
                    why = pipe.relay(chunk)
                    continue
                if state.finished:
                    # Some engines (transformers serve) never send [DONE]: the
                    # generation is complete, so end it the OpenAI way.
                    done = self.dialect.finish() if self.typed else _DONE
                    state.done = True
                    await out.send(done)
                    return None
                return watch.cut_by or NO_DONE
        finally:
            resp.unsink()
            watch.stop()
            proxy.unwatch_stream(target.name, watch)

    def frame(
        self, events: list[SSEEvent], parts: list[bytes], rewriting: bool = False
    ) -> Cut | None:
        """Append to `parts` what the client gets of `events`; returns None after `[DONE]`,
        a `Cut` when the upstream sent something broken, else `GO_ON`."""
        state = self.state
        for ev in events:
            data = ev.data
            if data is None:
                if not _plain_sse(ev.raw):
                    return MALFORMED  # an HTML page, binary: never the client's to see
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
                return MALFORMED
            if not isinstance(obj, dict):
                return MALFORMED
            if rewriting:
                if self.exact is not None:  # completions chunks, in the client's framing
                    obj = self.exact.to_client(obj, self.req.api)
                b = rewrite(state, obj, self.include_usage)
                if b is not None:
                    parts.append(b)
                continue
            raw = ev.raw
            ids = self.ids
            if ids is not None:
                raw = ids.take(obj, raw)  # ids noted; `null` unless the client asked
                if not ids.whole and ids.barren:  # an attribute per token; the rest rarely
                    self.ids = None  # this engine sends none: nothing to note from here on
            if self.stops is not None:
                filtered = self.stops.feed(obj)
                if filtered is None:
                    continue
                # The filter edits the chunk in place (held back or cut text): re-made.
                obj, raw = filtered, b"data: " + orjson.dumps(filtered) + b"\n\n"
            track(state, obj)
            usage = obj.get("usage")
            if usage is not None and not self.continuous_usage:
                _usage_openai_way(obj, raw, parts, self.include_usage)
                if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                    self.ex.tokens_in = usage["prompt_tokens"]
            else:
                parts.append(raw)  # the pass-through path: the backend's bytes, unchanged
        return GO_ON

    async def _end_with_error(self, message: str) -> None:
        self.ex.error = "upstream_stream_broken"
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._out.send(self.dialect.error(message))
            await self._out.end()


async def _continuation(relay: Relay, target: Target) -> Continuation | None:
    """The request continuing `relay`'s stream on `target`; None when every requested token
    has already reached the client.

    As token ids where the stream has them and `target` takes them (`dialects/token_ids.py`:
    the count is exact, no round trip). Else the text: the tokens sent are counted on
    `target` (`POST /tokenize`, vLLM's) when it answers: engines merge several tokens into
    one event when their API loop lags (vLLM: 200 tokens in 135-202 events, up to 19 in
    one), so the event count undercounts, and the continuation would be asked for too many
    tokens (803 for `max_tokens` 800) and the merged usage would be wrong. Without
    `/tokenize` the event count stands."""
    state = relay.state
    ids = relay.exact = relay.ids
    if ids is not None and ids.usable(target):
        state.tokens = ids.sent()
    else:
        relay.ids = relay.exact = None  # text replay: the ids stop matching what is sent
        counted = await relay.opener.count_tokens(target, relay.req.model, state.sent_text(0))
        if counted is not None:
            state.tokens = counted
    if relay.all_sent():
        return None
    state.tokens_before = state.tokens
    if relay.exact is not None:
        return relay.exact.continuation(relay.doc, relay.req.api, state)
    return relay.dialect.continuation(relay.doc, target.resume)


def _framing(relay: Relay, rewriting: bool) -> Framing:
    """How `relay` makes its client's bytes of an upstream's events (`pipe.py`)."""
    if relay.typed:
        dialect = relay.dialect
        return lambda events, parts: _relay_typed(dialect, events, parts, rewriting)
    if not rewriting:
        return relay.frame  # the usual stream: one call per read less than a lambda
    return lambda events, parts: relay.frame(events, parts, True)


def _watchdog(relay: Relay, name: str, resp: UpstreamResponse) -> Watchdog:
    """The stall watchdog of one upstream of `relay`, following backend `name`'s rhythm
    from this upstream's first token on (`rhythm.py`)."""
    s = relay.settings
    rhythm = relay.opener.rhythms.itl(name) if s.stall_factor > 0 else None
    watch = Watchdog(
        relay.clock,
        resp,
        s.stall,
        relay.may_cut,
        relay.deadline,
        rhythm,
        s.stall_floor,
        s.stall_factor,
    )
    watch.tokens_from = relay.state.tokens
    return watch


def _blame(outcomes: Outcomes, stall: float, name: str, cut: Cut) -> None:
    """Tell the health core what the cut says about the backend."""
    ev = cut.evidence
    if ev is Evidence.SUSPECT:
        # Our own watchdog cut a quiet stream: suspect evidence (new requests go
        # elsewhere, probes speed up), not a hard failure. A busy but healthy engine
        # must not be ejected by five slow streams (R17, R21).
        outcomes.report(name, FirstByteOverdue(1, stall))
    elif ev is Evidence.FAILURE:
        outcomes.report(name, RequestResult(Outcome.STREAM_BROKEN, None, None))


def _relay_typed(
    dialect: Dialect, events: list[SSEEvent], parts: list[bytes], rewriting: bool
) -> Cut | None:
    """`Relay.frame` for a typed stream (Responses, Messages): the first upstream's events
    pass byte for byte while the dialect notes them, a continuation's are rewritten by it;
    None once the terminal event went out."""
    state = dialect.state
    for ev in events:
        data = ev.data
        if data is None:
            if not _plain_sse(ev.raw):
                return MALFORMED
            if not rewriting:
                parts.append(ev.raw)  # comments / keep-alives
            continue
        if rewriting and data == b"[DONE]":  # a continuation in chat chunks (Messages)
            if not state.done:
                parts.append(dialect.finish())
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return MALFORMED
        if not isinstance(obj, dict):
            return MALFORMED
        if rewriting:
            b = dialect.rewrite(obj)
            if b is not None:
                parts.append(b)
        else:
            dialect.track(obj)
            parts.append(ev.raw)
        if state.done:
            return None
    return GO_ON


def _usage_openai_way(
    obj: dict[str, Any], raw: bytes, parts: list[bytes], include_usage: bool
) -> None:
    """`usage` only when asked, in its own chunk with `choices: []` (OpenAI, vLLM).
    Some engines (transformers serve) always put it on the last content chunk."""
    usage = obj["usage"]
    if not obj.get("choices"):
        if include_usage:
            parts.append(raw)  # already the OpenAI way
        return
    del obj["usage"]
    parts.append(b"data: " + orjson.dumps(obj) + b"\n\n")
    if include_usage:
        extra = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        parts.append(b"data: " + orjson.dumps({**extra, "choices": [], "usage": usage}))
        parts.append(b"\n\n")


__all__ = ["Closable", "Relay", "StreamSettings"]
