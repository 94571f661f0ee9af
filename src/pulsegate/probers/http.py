"""The probers' one HTTP seam: a probe-only session, one bounded request, failures named once.

Every active probe goes through `fetch`: one request under one hard deadline that covers
pool wait, connect, send, response headers and the (capped) body. The deadline counts time
this process was running (`pulsegate.stall`): a stall of the gateway's own event loop
pushes it back, so a backend that answered in time is never failed for our pause.
Transport errors are translated here, and only here, into the short reasons the health
core logs and alerts with ("timeout after 350ms", "connection refused", "HTTP 500: CUDA
out of memory").

Connection hygiene: a request that fails mid-flight (deadline, reset, short body) never
goes back to the pool - aiohttp closes a connection whose response was not read to the
end, and `fetch` closes the response explicitly on every failure. So a connection stalled
behind a blackholed send cannot poison the next probe.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from pulsegate import stall
from pulsegate.clock import Clock

PROBE_HEADER = "x-pulsegate-probe"
USER_AGENT = "pulsegate-prober/0.1"

# Per backend at most one probe of each kind is in flight: readiness (its two requests run
# one after the other), micro-inference, canary, metrics scrape -> 4 connections. A smaller
# limit would make the 350 ms canary wait in the pool behind a hung micro-inference and fail
# for the wrong reason; a larger one is never used.
PROBE_CONNECTIONS_PER_BACKEND = 4

ERROR_CHARS = 120  # how much of a backend's error message a reason carries
_ERROR_BODY_CAP = 8 * 1024


class BodyTooLarge(Exception):
    """The response body exceeded the cap the caller set; the connection was dropped."""


# What `fetch` raises when the backend gives no usable answer (anything else is our bug).
FETCH_ERRORS = (TimeoutError, aiohttp.ClientError, BodyTooLarge)


@dataclass(frozen=True, slots=True)
class Reply:
    """A response that came back in time. `headers_s` is the time to the first byte."""

    status: int
    headers_s: float
    body: bytes
    retry_after: bool = False


def new_probe_session(*, per_backend: int = PROBE_CONNECTIONS_PER_BACKEND) -> aiohttp.ClientSession:
    """A session for probes only: its own pool, so probes never queue behind client traffic.

    No cookies, no session-wide timeout (each probe brings its own deadline).
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=per_backend, ttl_dns_cache=10)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
        headers={"User-Agent": USER_AGENT},
    )


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    timeout_s: float,
    clock: Clock,
    body: bytes | None = None,
    cap: int = 1 << 20,
) -> Reply:
    """One request under a hard deadline. Raises TimeoutError, aiohttp.ClientError or
    BodyTooLarge; an error status is a `Reply`, not an exception. 2xx bodies are read up to
    `cap` bytes, error bodies up to 8 KiB (enough for the message). `clock` times the
    deadline (`stall.timeout`) and the time to the first byte."""
    hdrs = dict(headers)
    if body is not None:
        hdrs["Content-Type"] = "application/json"
    t0 = clock.now()
    async with stall.timeout(clock, timeout_s):
        resp = await session.request(method, url, data=body, headers=hdrs, allow_redirects=False)
        try:
            headers_s = clock.now() - t0
            limit = cap if resp.status < 300 else _ERROR_BODY_CAP
            data = await _read_capped(resp, limit, strict=resp.status < 300)
        except BaseException:
            resp.close()  # drop the connection: it may be mid-response or stalled
            raise
        resp.release()
        return Reply(resp.status, headers_s, data, retry_after="Retry-After" in resp.headers)


async def _read_capped(resp: aiohttp.ClientResponse, cap: int, *, strict: bool) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= cap:
        chunk = await resp.content.read(64 * 1024)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    if strict:
        raise BodyTooLarge(f"response body over {cap} bytes")
    resp.close()  # an error body we only need the start of
    return b"".join(chunks)[:cap]


def describe_failure(exc: BaseException, timeout_s: float) -> str:
    """The reason for a probe that got no usable answer, short enough for an alert line."""
    if isinstance(exc, TimeoutError):  # our deadline, or aiohttp's own timeouts
        return f"timeout after {timeout_s * 1000:.0f}ms"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _os_reason(exc.os_error, "connect error")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "truncated response"
    if isinstance(exc, aiohttp.ClientOSError):
        return _os_reason(exc, "connection error")
    if isinstance(exc, BodyTooLarge):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]


def is_refused(exc: BaseException) -> bool:
    """The connection was refused: nothing listens on the backend's port."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.errno == errno.ECONNREFUSED
    return isinstance(exc, ConnectionRefusedError)


def _os_reason(err: OSError, prefix: str) -> str:
    if err.errno == errno.ECONNREFUSED:
        return "connection refused"
    if err.errno == errno.ECONNRESET:
        return "connection reset"
    if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "host unreachable"
    return f"{prefix}: {err.strerror or err}"[:ERROR_CHARS]


def http_reason(reply: Reply, what: str = "") -> str:
    """``HTTP 500: CUDA out of memory`` (first 120 chars of the backend's error message)."""
    head = f"{what} HTTP {reply.status}" if what else f"HTTP {reply.status}"
    msg = error_message(reply.body)
    return f"{head}: {msg}" if msg else head


def error_message(body: bytes) -> str:
    """The message out of an error body in OpenAI, vLLM, TGI or FastAPI shape, else its text."""
    msg: object = None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        msg = body.decode("utf-8", "replace")
    else:
        msg = doc
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict):
                msg = err.get("message")
            elif isinstance(err, str):  # TGI, llama.cpp
                msg = err
            else:
                msg = doc.get("message", doc.get("detail", doc))
    text = msg if isinstance(msg, str) else orjson.dumps(msg).decode() if msg else ""
    return " ".join(text.split())[:ERROR_CHARS]
