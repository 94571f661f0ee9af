"""OpenAI-shaped error responses, built in one place.

Clients (the openai SDK above all) parse `{"error": {"message", "type", "code"}}`; every error
the gateway itself produces uses that shape and a fitting status. Messages never include
request headers or secrets.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_body(status: int, message: str, code: str) -> bytes:
    err = {"message": message, "type": _TYPES.get(status, "error"), "code": code}
    return orjson.dumps({"error": err})


def error_response(
    status: int,
    message: str,
    code: str,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, code),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """A terminal SSE event for a stream that cannot finish: never a silent truncation."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
