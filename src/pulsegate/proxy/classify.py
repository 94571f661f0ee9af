"""One place that maps transport and HTTP failures to an Outcome.

The outcome decides two things: whether the request may go to the next backend (only while
nothing has reached the client), and whether it counts against the backend's health.

    exception / status                          outcome          retry elsewhere  counts
    ------------------------------------------  ---------------  ---------------  ------
    ConnectFailed: refused, DNS, TLS, OS errors CONNECT_ERROR    yes              yes
    ConnectionLost (reset/EOF) before headers   CONNECT_ERROR    yes              yes
    ConnectTimeout, or no headers / first byte  TIMEOUT          yes              yes
      before the attempt's deadline
    5xx (except 501, 505: the request's fault)  HTTP_5XX         yes              yes
    429, or 503 with Retry-After                OVERLOADED       yes              no
    reset / EOF / malformed body after headers  STREAM_BROKEN    yes if no bytes  yes
    malformed response (ProtocolError)          STREAM_BROKEN    yes if no bytes  yes
    other 4xx                                   CLIENT_ERROR     no (pass on)     no

The exceptions are the proxy path's upstream client's (`upstream.py`); a reused keep-alive
connection found closed before any response byte was already retried once there.
"""

from __future__ import annotations

import asyncio

from pulsegate.health.observations import Outcome
from pulsegate.proxy.upstream import (
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    ProtocolError,
)


def classify_status(status: int, has_retry_after: bool) -> Outcome:
    if status < 400:
        return Outcome.OK
    if status == 429 or (status == 503 and has_retry_after):
        return Outcome.OVERLOADED
    if status >= 500 and status not in (501, 505):
        return Outcome.HTTP_5XX
    return Outcome.CLIENT_ERROR


def classify_exception(exc: BaseException, got_headers: bool) -> Outcome:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | ConnectTimeout):
        return Outcome.TIMEOUT
    if got_headers or isinstance(exc, ProtocolError):
        return Outcome.STREAM_BROKEN
    return Outcome.CONNECT_ERROR  # ConnectFailed, ConnectionLost, any other OSError


def describe(exc: BaseException) -> str:
    """Short, secret-free words for an event or an error message."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectFailed | ConnectTimeout | ConnectionLost | ProtocolError):
        return str(exc)  # made by upstream.py from errno words only, never a header
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    return type(exc).__name__
