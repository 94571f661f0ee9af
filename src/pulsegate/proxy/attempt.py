"""The attempt opener: send one request to one backend, wait for its first byte, say how it went.

The one place that opens an upstream for the proxy (first attempts, retries, stream
continuations, the `/tokenize` count of a resume), classifies a failure (`classify.py`) and
reports the outcome to the health core. Nothing has reached the client when it returns, so
every `Failure` may still be retried elsewhere; `Failure.response` is the exception: the
backend judged the request itself bad (a 4xx), which is final.

A new upstream connection made during an attempt, or one that could not be made (timed out
within `retry.connect_timeout`, refused), is reported too, as a `ConnectResult`: the
evidence of a node that takes no new connection while pooled ones work (`health/connects.py`).
Only when the pool opened one: a request on a pooled connection reports nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from pulsegate import clock as _clock
from pulsegate.clock import Clock
from pulsegate.health.connects import OWN_ERRNOS
from pulsegate.health.observations import (
    ConnectResult,
    FirstByteOverdue,
    Outcome,
    RequestResult,
)
from pulsegate.proxy.classify import classify_exception, classify_status, describe
from pulsegate.proxy.errors import error_body
from pulsegate.proxy.exchange import Exchange
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.ports import Outcomes
from pulsegate.proxy.resume import token_count, tokenize_request
from pulsegate.proxy.rhythm import Rhythms
from pulsegate.proxy.state import ProxyState
from pulsegate.proxy.targets import Target
from pulsegate.proxy.upstream import (
    ConnectFailed,
    ConnectTimeout,
    ProtocolError,
    Response,
    Upstream,
    UpstreamError,
)

_OK_NONSTREAM = RequestResult(Outcome.OK, None, 200)
_CONNECT_OK = ConnectResult(True)
# Counting the sent text's tokens on the continuation target: ~1-50 ms for vLLM; past this
# the event count is used rather than delay the resume further.
TOKENIZE_TIMEOUT_S = 2.0
_ERROR_CODES = {400: "invalid_request", 404: "not_found"}


@dataclass(slots=True)
class Failure:
    outcome: Outcome
    status: int | None
    detail: str
    retry_after: str | None = None
    # A client error from the backend is final: pass it on as it came.
    response: web.Response | None = None


class Opened:
    """An upstream whose first byte arrived: a stream's first chunk, or an answer whole.
    (A plain class, made per request: see `request.ProxyRequest`.)"""

    __slots__ = ("first", "resp", "target")

    def __init__(self, target: Target, resp: Response, first: bytes) -> None:
        self.target = target
        self.resp = resp
        self.first = first


# The tracer's hook (`observe/traces.py`): the headers that carry this attempt's trace
# context upstream (`traceparent`); the attempt is the exchange's last.
TraceHeaders = Callable[[Exchange, Target], Mapping[str, str]]


class AttemptOpener:
    __slots__ = ("_clock", "_metrics", "_outcomes", "_state", "_upstream", "rhythms", "trace")

    def __init__(
        self,
        upstream: Upstream,
        state: ProxyState,
        outcomes: Outcomes,
        metrics: ProxyMetrics,
        clock: Clock,
    ) -> None:
        self._upstream = upstream
        self._state = state
        self._outcomes = outcomes
        self._metrics = metrics
        self._clock = clock
        self.trace: TraceHeaders | None = None  # set while tracing is on
        # Each backend's times to first token and inter-token gaps (`rhythm.py`): fed here
        # and by the relays, read by the stall rule and the hedge.
        self.rhythms = Rhythms()

    def late(self, name: str, waited_s: float) -> None:
        """A first byte from `name` is later than its peers' usual (the hedge fired): evidence,
        as the first-byte watch's overdue report (`health/suspect.py`)."""
        self._outcomes.report(name, FirstByteOverdue(1, waited_s))

    async def open(
        self,
        target: Target,
        path: str,
        body: bytes,
        stream: bool,
        deadline: float,
        ex: Exchange | None = None,
    ) -> Opened | Failure:
        """Send the request and wait for its first byte (at most `deadline` seconds of our
        running time): a stream's first chunk, or a non-streamed answer whole. Reports the
        outcome to the health core. `ex`: the client's exchange, whose last attempt this is
        (for the tracer's `traceparent`)."""
        state = self._state
        name = target.name
        now = self._clock.now
        t0 = now()
        token = state.first_byte.watch(name, t0) if stream else None
        got_headers = False
        resp: Response | None = None
        pool = self._upstream.pool(name, target.url, target.headers)
        connects = pool.connects  # moved: this attempt (or one beside it) made a connection
        trace = self.trace
        extra = None if trace is None or ex is None else trace(ex, target)
        try:
            # Watched while it waits, so an ejection of this backend cuts the wait at once:
            # nothing has reached the client yet, so the request just moves on.
            async with state.deadline(name, deadline, token) as cm:
                resp = await pool.post(path, body, extra)
                got_headers = True
                if resp.status >= 400:
                    state.unwatch_pending(name, cm)  # it reports (and may eject) itself
                    return await self._upstream_error(target, resp, t0)
                if stream:
                    data = await resp.read_chunk()
                else:
                    data = await resp.read()
                    if resp.status == 200 and not _json_object(data):
                        raise ProtocolError("a 200 answer that is not a JSON object")
                    resp.release()
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()  # the client left: never leave a half-read connection behind
            raise
        except (UpstreamError, OSError, TimeoutError) as e:
            outcome = classify_exception(e, got_headers)
            if resp is not None:
                resp.close()
            # The scope is left, so this attempt is unwatched before it reports: the report
            # may eject this backend, and the cut must not reach an attempt already done.
            if isinstance(e, TimeoutError) and self._own_stall(t0, deadline):
                # Our own loop stood still for part of the wait: the attempt moves on, but
                # the backend is not blamed for time we were not running (pulsegate.clock).
                return Failure(outcome, None, f"{name}: {describe(e)} (gateway stalled)")
            if self._new_connection_failed(e, t0):
                self._outcomes.report(name, ConnectResult(False, describe(e)))
            self._outcomes.report(name, RequestResult(outcome, None, None))
            return Failure(outcome, None, f"{name}: {describe(e)}")
        finally:
            if token is not None:
                state.first_byte.seen(name, token)
            if pool.connects != connects:
                self._outcomes.report(name, _CONNECT_OK)
        # A non-streamed answer arrives whole: its time is generation time, not time to
        # first token, and must not look like latency to the health core (R17).
        if stream:
            ttft = now() - t0
            self._outcomes.report(name, RequestResult(Outcome.OK, ttft, resp.status))
            self._metrics.ttft.observe(ttft)
            self.rhythms.first_token(name, ttft)
        else:
            self._outcomes.report(name, _OK_NONSTREAM)
        return Opened(target, resp, data)

    async def count_tokens(self, target: Target, model: str, text: str) -> int | None:
        """Tokens in `text` by `target`'s tokenizer (`POST /tokenize`, vLLM's), through the
        same pools as every request, or None when it cannot tell us in time."""
        if not text:
            return 0
        pool = self._upstream.pool(target.name, target.url, target.headers)
        resp: Response | None = None
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                resp = await pool.post("/tokenize", tokenize_request(model, text))
                data = await resp.read()
                resp.release()
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()
            raise
        except (UpstreamError, OSError, TimeoutError):
            if resp is not None:
                resp.close()
            return None
        return token_count(data) if resp.status == 200 else None

    async def _upstream_error(self, target: Target, resp: Response, t0: float) -> Failure:
        status = resp.status
        retry_after = resp.headers.get("retry-after")
        outcome = classify_status(status, retry_after is not None)
        try:
            data = await resp.read()
        finally:
            resp.release()
        self._outcomes.report(target.name, RequestResult(outcome, self._clock.now() - t0, status))
        if outcome is Outcome.CLIENT_ERROR:
            status, data = normalize_error(status, data, target.name)
            headers = {"content-type": "application/json", "x-pulsegate-backend": target.name}
            return Failure(
                outcome,
                status,
                "client error",
                response=web.Response(status=status, body=data, headers=headers),
            )
        return Failure(outcome, status, f"{target.name}: HTTP {status}", retry_after)

    def _new_connection_failed(self, e: BaseException, t0: float) -> bool:
        """`e` says a new connection could not be made, and not for our own sake: no stall
        of our loop excuses the timeout, no shortage of ours (`OWN_ERRNOS`) the failure."""
        if isinstance(e, ConnectTimeout):
            return not self._own_stall(t0, self._upstream.connect_timeout)
        if isinstance(e, ConnectFailed):
            return e.os_error is None or e.os_error.errno not in OWN_ERRNOS
        return False

    def _own_stall(self, t0: float, deadline: float) -> bool:
        """The deadline since `t0` ran out only because this process's loop was stalled."""
        now = self._clock.now()
        excused = _clock.excuse(self._clock, t0, now)
        return excused > 0.0 and now - t0 - excused < deadline


def _json_object(data: bytes) -> bool:
    """Whether a 200 answer can be a JSON object: its first non-space byte is `{` and its
    last `}`.

    Every answer the proxy forwards whole (chat, completions, responses, messages,
    embeddings, rerank, score, tokenize) is a JSON object, and what backends send instead
    (an HTML page from a proxy in front of the engine, plain text, an empty body) never
    starts with `{`; a body whose Content-Length is too small (a cut object) almost never
    ends with `}`, and one cut by a lost connection is caught by its framing. A full parse
    costs ~50 ms per MiB on the loop (195 ms for 4 MiB); this looks at a few bytes."""
    return data[:64].lstrip()[:1] == b"{" and data[-64:].rstrip()[-1:] == b"}"


def normalize_error(status: int, body: bytes, backend: str = "backend") -> tuple[int, bytes]:
    """A backend's 4xx in OpenAI's shape: an `{"error": {...}}` body passes unchanged;
    FastAPI's `{"detail": ...}` or plain text is wrapped; 422 (FastAPI validation) is 400.
    A 401 or 403 is the backend refusing the gateway's own credentials (`api_key_env`), not
    the client's: a 502 naming `backend`, none of its body (hosted APIs echo the key)."""
    if status in (401, 403):
        message = (
            f"backend '{backend}' refused the gateway's credentials (HTTP {status}); "
            "check its api_key_env"
        )
        return 502, error_body(502, message, "upstream_auth_failed")
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
    return status, error_body(status, message, _ERROR_CODES.get(status, "upstream_client_error"))
