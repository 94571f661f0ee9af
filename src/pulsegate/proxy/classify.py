"""One place that maps transport and HTTP failures to an Outcome.

The outcome decides two things: whether the request may go to the next backend (only while
nothing has reached the client), and whether it counts against the backend's health.

    exception / status                          outcome          retry elsewhere  counts
    ------------------------------------------  ---------------  ---------------  ------
    connect refused/reset, DNS, TLS, OS errors  CONNECT_ERROR    yes              yes
    no headers / first byte before deadline     TIMEOUT          yes              yes
    5xx (except 501, 505: the request's fault)  HTTP_5XX         yes              yes
    429, or 503 with Retry-After                OVERLOADED       yes              no
    disconnect / payload error after headers    STREAM_BROKEN    yes if no bytes  yes
    other 4xx                                   CLIENT_ERROR     no (pass on)     no
"""

from __future__ import annotations

import asyncio

import aiohttp

from pulsegate.health.observations import Outcome


def classify_status(status: int, has_retry_after: bool) -> Outcome:
    if status < 400:
        return Outcome.OK
    if status == 429 or (status == 503 and has_retry_after):
        return Outcome.OVERLOADED
    if status >= 500 and status not in (501, 505):
        return Outcome.HTTP_5XX
    return Outcome.CLIENT_ERROR


def classify_exception(exc: BaseException, got_headers: bool) -> Outcome:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return Outcome.TIMEOUT
    if got_headers:
        return Outcome.STREAM_BROKEN
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ServerDisconnectedError | OSError):
        return Outcome.CONNECT_ERROR
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return Outcome.STREAM_BROKEN
    return Outcome.CONNECT_ERROR


def describe(exc: BaseException) -> str:
    """Short, secret-free words for an event or an error message."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    return type(exc).__name__
