"""Error responses in each API's own shape, built in one place.

Clients (the openai SDK above all) parse `{"error": {"message", "type", "code"}}`; every error
the gateway itself produces uses that shape and a fitting status. Messages never include
request headers or secrets.

`/v1/messages` is Anthropic's API, and the anthropic SDK reads Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with its own types by status
(docs.anthropic.com "Errors"). The proxy path builds OpenAI's shape everywhere (its own
refusals, `attempt.normalize_error` for a backend's 4xx); `reshape` rewrites an answer in
the shape of its API at the route, a lookup by API done only for an error status, so the
success path pays nothing. A body already in the API's shape passes unchanged.
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


# Anthropic's error types by status; any other status is "api_error".
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    err = {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}
    return orjson.dumps({"type": "error", "error": err})


def _to_anthropic(resp: web.Response) -> web.Response:
    body = resp.body
    try:
        doc = orjson.loads(body) if isinstance(body, bytes) else None
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error":
        return resp  # already Anthropic's
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        message = err["message"]
    elif isinstance(body, bytes):
        message = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {resp.status}"
    else:
        message = f"HTTP {resp.status}"
    resp.body = anthropic_error_body(resp.status, message)
    resp.content_type = "application/json"
    return resp


# API label -> how an error answer of that API is re-shaped (absent: OpenAI's, as built).
_RESHAPE = {"messages": _to_anthropic}


def reshape(resp: web.StreamResponse, api: str) -> web.StreamResponse:
    """`resp` in `api`'s error shape when it is a whole error answer; else unchanged."""
    if resp.status < 400 or not isinstance(resp, web.Response):
        return resp
    fix = _RESHAPE.get(api)
    return resp if fix is None else fix(resp)


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
