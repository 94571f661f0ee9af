"""The request parse (`proxy/request.py`): pure, no process started."""

from __future__ import annotations

import orjson
import pytest

from pulsegate.config import parse_config
from pulsegate.proxy.request import (
    CHAT,
    COMPLETIONS,
    DEFAULT_MAX_TOKENS,
    Limits,
    ProxyRequest,
    Rejection,
    parse,
    prompt_head,
)


def _limits(prefix_chars: int = 0, max_n: int = 0) -> Limits:
    cfg = parse_config(
        {
            "backends": [
                {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"], "max_n": max_n},
                {"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]},
            ]
        }
    )
    return Limits(
        max_body=1000,
        per_try=2.0,
        per_token=0.01,
        request_timeout=30.0,
        prefix_chars=prefix_chars,
        backends=tuple(cfg.backends),
    )


def _chat(**extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def test_a_chat_request_yields_the_routing_fields_and_keeps_the_bytes() -> None:
    """Model, stream flag, deadline and stops are read; the body is the client's own bytes."""
    body = _chat(stream=True, stop=["\n\n"])
    req = parse(CHAT, body, None, _limits())
    assert isinstance(req, ProxyRequest)
    assert (req.model, req.stream, req.body, req.stops) == ("m", True, body, ("\n\n",))
    assert req.deadline == 2.0  # a stream waits per_try for its first token
    assert req.session_key is None and list(req.avoid) == []


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        (CHAT, b"{not json", 400, "invalid_json"),
        (CHAT, b"[1, 2]", 400, "invalid_request"),
        (CHAT, b'{"messages": [{"role": "user"}]}', 400, "missing_model"),
        (CHAT, b'{"model": "m", "messages": []}', 400, "missing_messages"),
        (COMPLETIONS, b'{"model": "m"}', 400, "missing_prompt"),
        (CHAT, _chat(temperature=3), 400, "invalid_request"),
        (CHAT, b"x" * 1001, 413, "request_too_large"),
    ],
)
def test_bad_requests_are_refused_with_a_named_code(
    path: str, body: bytes, status: int, code: str
) -> None:
    """Each malformed request gets its own status and code before any backend sees it."""
    r = parse(path, body, None, _limits())
    assert isinstance(r, Rejection)
    assert (r.status, r.code) == (status, code)
    assert r.message


def test_a_non_streamed_deadline_grows_with_max_tokens_within_the_request_timeout() -> None:
    """per_try + tokens x per_token, default 1024 tokens, capped by request_timeout."""
    lim = _limits()
    short = parse(CHAT, _chat(max_tokens=100), None, lim)
    default = parse(CHAT, _chat(), None, lim)
    huge = parse(CHAT, _chat(max_tokens=100_000), None, lim)
    assert isinstance(short, ProxyRequest) and short.deadline == pytest.approx(3.0)
    assert isinstance(default, ProxyRequest)
    assert default.deadline == pytest.approx(2.0 + DEFAULT_MAX_TOKENS * 0.01)
    assert isinstance(huge, ProxyRequest) and huge.deadline == 30.0


def test_the_session_key_is_the_header_then_user_then_the_prompt_head() -> None:
    """x-session-id wins over `user`; without either, prefix affinity keys on the prompt."""
    lim = _limits(prefix_chars=8)
    by_header = parse(CHAT, _chat(user="u1"), "s1", lim)
    by_user = parse(CHAT, _chat(user="u1"), None, lim)
    by_prefix = parse(CHAT, _chat(), None, lim)
    assert isinstance(by_header, ProxyRequest) and by_header.session_key == "s1"
    assert isinstance(by_user, ProxyRequest) and by_user.session_key == "u1"
    assert isinstance(by_prefix, ProxyRequest) and by_prefix.session_key is not None
    off = parse(CHAT, _chat(), None, _limits(prefix_chars=0))
    assert isinstance(off, ProxyRequest) and off.session_key is None


def test_n_beyond_a_backends_max_n_avoids_it_and_beyond_all_is_refused() -> None:
    """A backend answering fewer choices than `n` is never picked; none able: 400."""
    ok = parse(CHAT, _chat(n=2), None, _limits(max_n=1))
    assert isinstance(ok, ProxyRequest) and list(ok.avoid) == ["a"]
    cfg = parse_config(
        {"backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"], "max_n": 1}]}
    )
    lim = _limits()
    one = Limits(lim.max_body, 2.0, 0.01, 30.0, 0, tuple(cfg.backends))
    refused = parse(CHAT, _chat(n=2), None, one)
    assert isinstance(refused, Rejection) and "'n' must be at most 1" in refused.message


def test_prompt_head_takes_the_first_characters_across_messages() -> None:
    """System prompt and first turn, cut at k characters; a string prompt as it is."""
    doc = {"messages": [{"role": "system", "content": "abcd"}, {"role": "user", "content": "efgh"}]}
    assert prompt_head(doc, 6) == "abcdef"
    assert prompt_head({"prompt": "hello world"}, 5) == "hello"
