"""The parse of every API (`proxy/request.py`, `proxy/fields.py`) and `backends[].apis`:
pure, no process started."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pulsegate.config import ConfigError, parse_config
from pulsegate.proxy.errors import reshape
from pulsegate.proxy.request import API, Limits, ProxyRequest, Rejection, parse

GOOD: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi", "max_output_tokens": 50},
    "/v1/embeddings": {"input": ["a", "b"]},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
    "/rerank": {"query": "q", "documents": ["a"]},
    "/v2/rerank": {"query": "q", "documents": ["a"]},
    "/v1/score": {"text_1": "a", "text_2": ["b", "c"]},
    "/score": {"text_1": "a", "text_2": "b"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


def _limits(*backends: dict[str, Any]) -> Limits:
    if not backends:
        backends = ({"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]},)
    cfg = parse_config({"backends": list(backends)})
    return Limits(
        max_body=10_000,
        per_try=2.0,
        per_token=0.01,
        request_timeout=30.0,
        prefix_chars=0,
        backends=tuple(cfg.backends),
    )


def _body(path: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", **GOOD[path], **extra})


def test_every_route_has_a_spec_and_an_api_label() -> None:
    """Each proxied path parses a good body into a request labelled with its API."""
    assert set(GOOD) == set(API)
    for path in API:
        req = parse(path, _body(path), None, _limits())
        assert isinstance(req, ProxyRequest), (path, req)
        assert req.api == API[path] and req.path == path and req.body == _body(path)


@pytest.mark.parametrize(
    ("path", "doc", "code"),
    [
        ("/v1/responses", {}, "missing_input"),
        ("/v1/responses", {"input": "hi", "stream": "yes"}, "invalid_request"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "invalid_request"),
        ("/v1/embeddings", {"input": []}, "missing_input"),
        ("/v1/messages", {"max_tokens": 5}, "missing_messages"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "missing_max_tokens"),
        ("/v1/messages", {"messages": ["hi"], "max_tokens": 5}, "invalid_request"),
        ("/v1/rerank", {"documents": ["a"]}, "missing_query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "missing_documents"),
        ("/v1/score", {"text_1": "a"}, "missing_text"),
        ("/tokenize", {}, "missing_prompt"),
        ("/detokenize", {"tokens": ["a"]}, "missing_tokens"),
    ],
)
def test_each_api_refuses_a_body_without_its_required_fields(
    path: str, doc: dict[str, Any], code: str
) -> None:
    """A body the engine would refuse is a 400 naming the field, before any backend."""
    r = parse(path, orjson.dumps({"model": "m", **doc}), None, _limits())
    assert isinstance(r, Rejection) and (r.status, r.code) == (400, code), r
    assert r.message


@pytest.mark.parametrize("path", sorted(API))
def test_model_is_required_everywhere(path: str) -> None:
    """Routing is by model: every API needs one."""
    r = parse(path, orjson.dumps(GOOD[path]), None, _limits())
    assert isinstance(r, Rejection) and r.code == "missing_model"


def test_stream_only_where_the_api_streams() -> None:
    """responses and messages stream; `stream: true` on embeddings changes nothing."""
    lim = _limits()
    for path in ("/v1/responses", "/v1/messages"):
        req = parse(path, _body(path, stream=True), None, lim)
        assert isinstance(req, ProxyRequest) and req.stream and req.deadline == 2.0
    emb = parse("/v1/embeddings", _body("/v1/embeddings", stream=True), None, lim)
    assert isinstance(emb, ProxyRequest) and not emb.stream


def test_first_byte_deadline_follows_each_api_output_bound() -> None:
    """max_output_tokens (responses) and max_tokens (messages) size a whole answer's wait;
    the APIs that generate nothing wait per_try, like a first token."""
    lim = _limits()
    resp = parse("/v1/responses", _body("/v1/responses", max_output_tokens=300), None, lim)
    msgs = parse("/v1/messages", _body("/v1/messages", max_tokens=500), None, lim)
    assert isinstance(resp, ProxyRequest) and resp.deadline == pytest.approx(2.0 + 3.0)
    assert isinstance(msgs, ProxyRequest) and msgs.deadline == pytest.approx(2.0 + 5.0)
    for path in ("/v1/embeddings", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize"):
        req = parse(path, _body(path), None, lim)
        assert isinstance(req, ProxyRequest) and req.deadline == 2.0, path


def test_session_keys_per_api() -> None:
    """x-session-id first; then `user`, or Anthropic's metadata.user_id for messages."""
    lim = _limits()
    msgs = parse("/v1/messages", _body("/v1/messages", metadata={"user_id": "u7"}), None, lim)
    emb = parse("/v1/embeddings", _body("/v1/embeddings", user="u8"), None, lim)
    hdr = parse("/v1/messages", _body("/v1/messages", metadata={"user_id": "u7"}), "s1", lim)
    ignored = parse("/v1/messages", _body("/v1/messages", user="u9"), None, lim)
    assert isinstance(msgs, ProxyRequest) and msgs.session_key == "u7"
    assert isinstance(emb, ProxyRequest) and emb.session_key == "u8"
    assert isinstance(hdr, ProxyRequest) and hdr.session_key == "s1"
    assert isinstance(ignored, ProxyRequest) and ignored.session_key is None


def test_stop_and_n_only_for_chat_and_completions() -> None:
    """`stop` is OpenAI's field: a responses body's `stop` is not cut by the gateway."""
    req = parse("/v1/responses", _body("/v1/responses", stop=["x"]), None, _limits())
    assert isinstance(req, ProxyRequest) and req.stops == ()


CHAT_ONLY = {"name": "gen", "url": "http://127.0.0.1:9", "models": ["m"], "apis": ["chat"]}
EMBED = {"name": "emb", "url": "http://127.0.0.1:9", "models": ["m"], "apis": ["embeddings"]}
OTHER = {"name": "other", "url": "http://127.0.0.1:9", "models": ["x"]}


def test_a_backend_without_the_api_is_avoided() -> None:
    """`apis:` puts the backends that lack the request's API in its avoid list."""
    lim = _limits(CHAT_ONLY, EMBED)
    emb = parse("/v1/embeddings", _body("/v1/embeddings"), None, lim)
    chat = parse("/v1/chat/completions", _body("/v1/chat/completions"), None, lim)
    assert isinstance(emb, ProxyRequest) and list(emb.avoid) == ["gen"]
    assert isinstance(chat, ProxyRequest) and list(chat.avoid) == ["emb"]


def test_api_not_served_is_a_404_before_the_model_is_looked_at() -> None:
    """No backend serves rerank: 404 api_not_served, whatever the model (even unknown)."""
    lim = _limits(CHAT_ONLY, EMBED)
    for model in ("m", "nobody-has-it"):
        body = orjson.dumps({**GOOD["/v1/rerank"], "model": model})
        r = parse("/v1/rerank", body, None, lim)
        assert isinstance(r, Rejection) and (r.status, r.code) == (404, "api_not_served")
        assert "rerank" in r.message
    tok = parse("/detokenize", _body("/detokenize"), None, lim)  # detokenize is `tokenize`
    assert isinstance(tok, Rejection) and tok.code == "api_not_served"


def test_api_not_served_for_this_model_only() -> None:
    """Embeddings exist, but not for model x: 404 api_not_served; an unknown model is
    left to route's model_not_found."""
    lim = _limits({**EMBED}, {**OTHER, "apis": ["chat"]})
    r = parse("/v1/embeddings", orjson.dumps({"model": "x", "input": "a"}), None, lim)
    assert isinstance(r, Rejection) and r.code == "api_not_served" and "'x'" in r.message
    unknown = parse("/v1/embeddings", orjson.dumps({"model": "zz", "input": "a"}), None, lim)
    assert isinstance(unknown, ProxyRequest) and list(unknown.avoid) == ["other"]


def test_a_backend_with_discovered_models_may_serve_any_model() -> None:
    """A backend without `models:` (discovered) counts as a server of every model."""
    lim = _limits({"name": "d", "url": "http://127.0.0.1:9", "apis": ["embeddings"]}, CHAT_ONLY)
    req = parse("/v1/embeddings", _body("/v1/embeddings"), None, lim)
    assert isinstance(req, ProxyRequest) and list(req.avoid) == ["gen"]


def test_avoid_joins_the_apis_and_max_n() -> None:
    """n beyond a backend's max_n and a backend without chat are both avoided."""
    small = {"name": "small", "url": "http://127.0.0.1:9", "models": ["m"], "max_n": 1}
    lim = _limits(small, EMBED, {"name": "big", "url": "http://127.0.0.1:9", "models": ["m"]})
    req = parse("/v1/chat/completions", _body("/v1/chat/completions", n=2), None, lim)
    assert isinstance(req, ProxyRequest) and sorted(req.avoid) == ["emb", "small"]


def test_apis_default_by_engine_kind() -> None:
    """vllm serves all eight; tgi chat and completions; an explicit list wins."""
    cfg = parse_config(
        {
            "backends": [
                {"name": "v", "url": "http://127.0.0.1:9"},
                {"name": "t", "url": "http://127.0.0.1:9", "engine": "tgi"},
                {"name": "e", "url": "http://127.0.0.1:9", "engine": "tgi", "apis": ["chat"]},
            ]
        }
    )
    v, t, e = cfg.backends
    assert len(v.apis) == 8 and v.engine == "vllm"
    assert t.apis == ("chat", "completions")
    assert e.apis == ("chat",)


@pytest.mark.parametrize(
    ("entry", "path", "fragment"),
    [
        ({"apis": ["chat", "embedings"]}, "backends[0].apis", "unknown api 'embedings'"),
        ({"apis": []}, "backends[0].apis", "non-empty list"),
        ({"apis": ["chat", "chat"]}, "backends[0].apis", "twice"),
        ({"engine": "tensorrt"}, "backends[0].engine", "must be one of"),
    ],
)
def test_bad_apis_and_engine_name_the_key(entry: dict[str, Any], path: str, fragment: str) -> None:
    """A typo in `apis` or `engine` is a config error naming its key path."""
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:9", **entry}]})
    assert any(m.startswith(path) and fragment in m for m in e.value.errors), e.value.errors


def test_messages_errors_take_anthropic_shape() -> None:
    """An OpenAI-shaped error on /v1/messages leaves as Anthropic's; other APIs keep OpenAI's;
    an answer already in Anthropic's shape and a success pass unchanged."""
    from aiohttp import web

    from pulsegate.proxy.errors import anthropic_error_body, error_response

    out = reshape(error_response(404, "the rerank API is not served", "api_not_served"), "messages")
    doc = orjson.loads(out.body)  # type: ignore[attr-defined]
    assert doc == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "the rerank API is not served"},
    }
    for status, kind in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (429, "rate_limit_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ]:
        out = reshape(error_response(status, "m", "c"), "messages")
        assert orjson.loads(out.body)["error"]["type"] == kind  # type: ignore[attr-defined]
    same = error_response(400, "m", "c")
    assert reshape(same, "embeddings") is same
    theirs = anthropic_error_body(429, "slow down")
    kept = reshape(web.Response(status=429, body=theirs), "messages")
    assert kept.body == theirs  # type: ignore[attr-defined]
    ok = web.Response(status=200, body=b'{"id": "msg_1"}')
    assert reshape(ok, "messages") is ok
    assert orjson.loads(same.body)["error"]["code"] == "c"  # type: ignore[arg-type]
