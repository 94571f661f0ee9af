"""Failure naming: one place turns backend answers and transport errors into reasons."""

from __future__ import annotations

import errno

import aiohttp
import pytest

from pulsegate.probers.http import Reply, describe_failure, error_message, http_reason


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "CUDA out of memory", "type": "x"}}', "CUDA out of memory"),
        (
            b'{"object": "error", "message": "The model `x` does not exist."}',
            "The model `x` does not exist.",
        ),
        (b'{"error": "Model is overloaded", "error_type": "overloaded"}', "Model is overloaded"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"upstream\n  connect error", "upstream connect error"),
        (b"", ""),
    ],
)
def test_error_message_shapes(body: bytes, message: str) -> None:
    """OpenAI, vLLM, TGI, FastAPI and plain-text error bodies yield their message."""
    assert error_message(body) == message


def test_http_reason_caps_the_message() -> None:
    """A long message is cut to 120 characters after 'HTTP 500: '."""
    reply = Reply(500, 0.01, b'{"error": {"message": "' + b"x" * 500 + b'"}}')
    assert http_reason(reply) == "HTTP 500: " + "x" * 120
    assert http_reason(Reply(503, 0.01, b""), "health") == "health HTTP 503"


def test_transport_failures_are_named() -> None:
    """Timeouts, refusals and resets read as short, stable reasons."""
    assert describe_failure(TimeoutError(), 0.35) == "timeout after 350ms"
    reset = aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer")
    assert describe_failure(reset, 1) == "connection reset"
    assert describe_failure(aiohttp.ServerDisconnectedError(), 1) == "server disconnected"
