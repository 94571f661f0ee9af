"""JSON that would hold the event loop: refused by counting before any parse."""

from __future__ import annotations

import orjson
import pytest

from pulsegate.proxy.request import (
    CHAT,
    MAX_CONTAINERS,
    MAX_SEPARATORS,
    Limits,
    ProxyRequest,
    Rejection,
    parse,
)

MiB = 1024 * 1024
LIMITS = Limits(4 * MiB, 2.0, 0.01, 30.0, 0, ())
EMBEDDINGS = "/v1/embeddings"


def _flood(item: bytes, n: int) -> bytes:
    return (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":['
        + b",".join([item] * n)
        + b"]}"
    )


@pytest.mark.parametrize(
    ("name", "body", "what"),
    [
        ("1.3M empty objects", _flood(b"{}", 1_300_000), "objects and arrays"),
        ("1.3M empty arrays", _flood(b"[]", 1_300_000), "objects and arrays"),
        ("just over the containers", _flood(b"{}", MAX_CONTAINERS), "objects and arrays"),
        ("2M integers", _flood(b"1", 2_000_000), "JSON values"),
        ("1.3M empty strings", _flood(b'""', 1_300_000), "JSON values"),
    ],
)
def test_a_body_of_too_many_values_is_refused_unparsed(name: str, body: bytes, what: str) -> None:
    """Each of these took 65-800 ms of the loop to parse: a 400 naming the bound instead."""
    r = parse(CHAT, body, None, LIMITS)
    assert isinstance(r, Rejection), name
    assert (r.status, r.code) == (400, "invalid_request")
    assert what in r.message and "split the request" in r.message


def test_just_under_the_bounds_is_parsed() -> None:
    body = _flood(b"{}", MAX_CONTAINERS - 10)
    assert isinstance(parse(CHAT, body, None, LIMITS), ProxyRequest)
    body = _flood(b"1", MAX_SEPARATORS - 10)
    assert isinstance(parse(CHAT, body, None, LIMITS), ProxyRequest)


def test_large_ordinary_requests_pass() -> None:
    """4 MiB of prose (300k commas), 300k token ids for embeddings (OpenAI's per-request
    limit), a prompt quoting 50k braces of JSON: all parsed."""
    prose = "hello, world this is text, " * 150_000
    chat = {"model": "m", "messages": [{"role": "user", "content": prose}]}
    assert isinstance(parse(CHAT, orjson.dumps(chat), None, LIMITS), ProxyRequest)
    ids = {"model": "m", "input": [[12345] * 500] * 600}
    assert isinstance(parse(EMBEDDINGS, orjson.dumps(ids), None, LIMITS), ProxyRequest)
    quoted = orjson.dumps([{"k": [1]}] * 25_000).decode()
    chat = {"model": "m", "messages": [{"role": "user", "content": quoted}]}
    assert isinstance(parse(CHAT, orjson.dumps(chat), None, LIMITS), ProxyRequest)


def test_a_small_body_is_never_counted() -> None:
    """Under 64 KiB nothing can be dense enough to matter: 20k empty objects pass through
    to the ordinary parse (and its own answer)."""
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":[' + b"{}," * 20_000
    assert len(body) < 64 * 1024
    r = parse(CHAT, body + b"{}]}", None, LIMITS)
    assert isinstance(r, ProxyRequest)
