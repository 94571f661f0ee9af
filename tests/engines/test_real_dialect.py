"""OpenAI's behaviour at the gateway's edge, whatever the engine behind it says.

Each test runs against a gateway in front of one real engine: vLLM (speaks OpenAI closely)
and transformers serve (several quirks: no `[DONE]`, usage always on the last chunk,
FastAPI-shaped errors, 500 for a bad field). The tests are the spec: what an OpenAI client
must see through pulsegate. Greedy decoding (`temperature: 0`) of the tiny model gives the
same text on both engines and never stops early, so every answer has exactly `max_tokens`
tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from engine_kit import LOG_DIR, MODEL, EnginePool, backend, gateway_config, sse_data

from support import Gateway

# The first test of a session waits for the engines to start: minutes on a busy box.
pytestmark = pytest.mark.timeout(600)
ENGINES = ["vllm-a", "hf"]
MSGS = [{"role": "user", "content": "hello world"}]
PROMPT = "the quick brown fox"
N = 12


@pytest.fixture(scope="module")
def gateways(pool: EnginePool) -> Iterator[dict[str, Gateway]]:
    """One gateway per engine, each with that engine as its only backend."""
    started: dict[str, Gateway] = {}
    try:
        for name in ENGINES:
            e = pool.get(name)
            tmp = LOG_DIR / f"gateway-{name}"
            tmp.mkdir(parents=True, exist_ok=True)
            started[name] = Gateway(tmp, gateway_config(backend(e)))
        for gw in started.values():
            gw.wait_all_ready(timeout=30)
        yield started
    finally:
        for gw in started.values():
            gw.stop()


@pytest.fixture(params=ENGINES)
def gw(request: pytest.FixtureRequest, gateways: dict[str, Gateway]) -> Gateway:
    return gateways[request.param]


@pytest.fixture(params=ENGINES)
def fresh_gw(
    request: pytest.FixtureRequest, pool: EnginePool, start_gateway: Callable[..., Gateway]
) -> Gateway:
    """A gateway of this test's own: a test that makes the engine fail (500s for bad fields)
    must not leave it ejected for the next one."""
    g = start_gateway(gateway_config(backend(pool.get(request.param))))
    g.wait_all_ready(timeout=30)
    return g


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/{path}", json=body, timeout=30)


def stream(gw: Gateway, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[bytes]]:
    with httpx.stream(
        "POST", f"{gw.url}/v1/{path}", json={**body, "stream": True}, timeout=30
    ) as r:
        return r, sse_data(r)


def chunks(events: list[bytes]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream (`[DONE]` left out); fails naming any other event."""
    out = []
    for e in events:
        if e != b"[DONE]":
            try:
                out.append(orjson.loads(e))
            except orjson.JSONDecodeError:
                pytest.fail(f"not a JSON event: {e[:300]!r}")
    return out


def text_of(objs: list[dict[str, Any]]) -> str:
    out = []
    for o in objs:
        for ch in o.get("choices") or ():
            piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
            out.append(piece or "")
    return "".join(out)


CHAT = ("chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": N, "temperature": 0})
COMPL = ("completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0})
BOTH = pytest.mark.parametrize(("path", "body"), [CHAT, COMPL], ids=["chat", "completions"])


# -- answers --------------------------------------------------------------------------------


def test_chat_answer_through_the_official_client(gw: Gateway) -> None:
    """A non-streamed chat comes back whole: text, finish_reason, usage, served by the engine."""
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=MSGS, max_tokens=N, temperature=0
    )
    r = raw.parse()
    assert raw.headers["x-pulsegate-backend"] in ENGINES
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == N


def test_completion_answer_through_the_official_client(gw: Gateway) -> None:
    """A non-streamed completion comes back whole with usage."""
    r = client(gw).completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == N


def _engine_own(raw: bytes) -> bytes:
    """`raw` with the engine's per-request id and timestamp blanked: whatever else differs
    between the engine's answer and the gateway's is the gateway's doing."""
    raw = re.sub(rb'"id":\s*"[^"]*"', b'"id":""', raw)
    return re.sub(rb'"created":\s*\d+', b'"created":0', raw)


def _skeleton(event: bytes) -> bytes:
    """One stream event with the text blanked too: vLLM merges tokens into events as its
    loop keeps up, so two runs' events differ in text, never in shape."""
    event = _engine_own(event)
    return re.sub(rb'"(content|text)":\s*"(?:[^"\\]|\\.)*"', rb'"\1":""', event)


@BOTH
def test_vllm_answer_passes_through_byte_for_byte(
    gateways: dict[str, Gateway], pool: EnginePool, path: str, body: dict[str, Any]
) -> None:
    """Where the engine already speaks OpenAI, the gateway's answer is the engine's bytes:
    the same request straight to vLLM and through the gateway differ only in vLLM's own id
    and timestamp. Streamed, every event keeps vLLM's shape (fields, order, spacing)."""
    gw, direct = gateways["vllm-a"].url, pool.get("vllm-a").url
    via = httpx.post(f"{gw}/v1/{path}", json=body, timeout=30)
    own = httpx.post(f"{direct}/v1/{path}", json=body, timeout=30)
    assert via.status_code == own.status_code == 200
    assert via.headers["x-pulsegate-backend"] == "vllm-a"
    assert _engine_own(via.content) == _engine_own(own.content)
    with httpx.stream("POST", f"{gw}/v1/{path}", json={**body, "stream": True}, timeout=30) as r:
        via_events = sse_data(r)
    with httpx.stream(
        "POST", f"{direct}/v1/{path}", json={**body, "stream": True}, timeout=30
    ) as r:
        own_events = sse_data(r)
    assert text_of(chunks(via_events)) == text_of(chunks(own_events))
    assert {_skeleton(e) for e in via_events} == {_skeleton(e) for e in own_events}


@BOTH
def test_stream_ends_with_exactly_one_done(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    """A stream is well-formed SSE, every event JSON, and ends with one `[DONE]`, last."""
    r, events = stream(gw, path, body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events.count(b"[DONE]") == 1, events[-3:]
    assert events[-1] == b"[DONE]"
    objs = chunks(events)
    assert len({o["id"] for o in objs}) == 1
    assert any(ch.get("finish_reason") == "length" for o in objs for ch in o.get("choices") or ())


@BOTH
def test_stream_text_equals_the_answer(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    """The streamed text is the non-streamed text (greedy), nothing lost at the edges."""
    whole = post(gw, path, body).json()["choices"][0]
    expected = whole["message"]["content"] if "message" in whole else whole["text"]
    _, events = stream(gw, path, body)
    assert text_of(chunks(events)) == expected


@BOTH
def test_no_usage_in_a_stream_unless_asked(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    """Without `stream_options.include_usage`, no chunk carries usage (OpenAI, vLLM)."""
    _, events = stream(gw, path, body)
    with_usage = [o for o in chunks(events) if o.get("usage") is not None]
    assert with_usage == []


@BOTH
def test_usage_when_asked_in_its_own_last_chunk(
    gw: Gateway, path: str, body: dict[str, Any]
) -> None:
    """With include_usage: one usage chunk, `choices: []`, right before `[DONE]`, counts right."""
    _, events = stream(gw, path, {**body, "stream_options": {"include_usage": True}})
    objs = chunks(events)
    with_usage = [o for o in objs if o.get("usage") is not None]
    assert len(with_usage) == 1, with_usage
    last = objs[-1]
    assert last is with_usage[0]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == N
    assert last["usage"]["prompt_tokens"] > 0
    assert last["usage"]["total_tokens"] == N + last["usage"]["prompt_tokens"]


def test_official_client_stream_with_usage(gw: Gateway) -> None:
    """The openai client's stream iterator gets every chunk and the usage it asked for."""
    s = client(gw).chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for c in s:
        if c.choices:
            text += c.choices[0].delta.content or ""
        if c.usage is not None:
            usage = c.usage
    assert text
    assert usage is not None and usage.completion_tokens == N


# -- errors ---------------------------------------------------------------------------------


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    doc = r.json()
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]
    assert "type" in err
    return err  # type: ignore[no-any-return]


@BOTH
def test_unknown_model_is_an_openai_404(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    """A model nobody serves: 404 `model_not_found`, before any engine sees it."""
    err = assert_openai_error(post(gw, path, {**body, "model": "no-such-model"}), 404)
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(gw).chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=1)


def test_missing_field_is_an_openai_400(gw: Gateway) -> None:
    """No `messages` / no `prompt`: 400 in OpenAI's shape (transformers serve: a plain 500)."""
    err = assert_openai_error(post(gw, "chat/completions", {"model": MODEL}), 400)
    assert err["code"] == "missing_messages"
    err = assert_openai_error(post(gw, "completions", {"model": MODEL}), 400)
    assert err["code"] == "missing_prompt"


@pytest.mark.parametrize(
    "bad",
    [{"max_tokens": "ten"}, {"temperature": -1}, {"messages": [{"role": "user", "content": 7}]}],
    ids=["max_tokens-string", "temperature-negative", "content-number"],
)
def test_invalid_field_is_an_openai_400(fresh_gw: Gateway, bad: dict[str, Any]) -> None:
    """A field of the wrong type or range is the client's fault: 400 in OpenAI's shape
    (transformers serve answers a plain-text 500 the gateway must not pass off as a 502)."""
    r = post(fresh_gw, "chat/completions", {**CHAT[1], **bad})
    assert_openai_error(r, 400)
    with pytest.raises(openai.BadRequestError):
        client(fresh_gw).chat.completions.create(**{**CHAT[1], **bad})


def test_unknown_field_is_accepted_or_an_openai_400(fresh_gw: Gateway) -> None:
    """A field the engine does not know: answered (vLLM) or refused as an OpenAI 400
    (transformers serve says 422 `{"detail": ...}`, FastAPI's shape)."""
    r = post(fresh_gw, "chat/completions", {**CHAT[1], "frobnicate": True})
    if r.status_code != 200:
        err = assert_openai_error(r, 400)
        assert "frobnicate" in err["message"]


def test_bad_requests_do_not_count_against_the_engine(fresh_gw: Gateway) -> None:
    """Ten invalid requests in a row leave the engine ready and unpunished: the request was
    wrong, not the engine (a 500 for a bad field must not eject a healthy engine)."""
    for _ in range(10):
        post(fresh_gw, "chat/completions", {**CHAT[1], "max_tokens": "ten"})
    (b,) = fresh_gw.backends().values()
    assert b["state"] == "ready", (b["state"], b["last_reason"])
    assert b["signals"]["consecutive_failures"] == 0
    assert b["ejections"] == 0


def test_stop_string_is_not_in_the_text(fresh_gw: Gateway) -> None:
    """`stop` ends the answer before the stop string, streamed or not (transformers serve
    leaves it in)."""
    full = post(fresh_gw, "chat/completions", {**CHAT[1], "max_tokens": 40}).json()
    text = full["choices"][0]["message"]["content"]
    stop = text[12:15]
    expected = text[: text.index(stop)]
    body = {**CHAT[1], "max_tokens": 40, "stop": [stop]}
    r = post(fresh_gw, "chat/completions", body).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == expected
    _, events = stream(fresh_gw, "chat/completions", body)
    assert text_of(chunks(events)) == expected


def test_n_is_honoured_or_refused(fresh_gw: Gateway) -> None:
    """`n: 2` gives two choices or an OpenAI 400, never one choice silently
    (transformers serve ignores `n`: its backend says `max_n: 1`)."""
    r = post(fresh_gw, "chat/completions", {**CHAT[1], "n": 2, "temperature": 1.0, "seed": 1})
    if r.status_code == 200:
        assert len(r.json()["choices"]) == 2
    else:
        assert_openai_error(r, 400)


def test_n_goes_to_the_engine_that_honours_it(
    pool: EnginePool, start_gateway: Callable[..., Gateway]
) -> None:
    """In a fleet of transformers serve and vLLM, every `n: 2` request is served by vLLM with
    two choices, whatever backend its session would be homed on."""
    g = start_gateway(gateway_config(backend(pool.get("hf")), backend(pool.get("vllm-a"))))
    g.wait_all_ready(timeout=60)
    body = {**CHAT[1], "temperature": 1.0, "seed": 1, "n": 2}
    for i in range(8):
        r = httpx.post(
            f"{g.url}/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"}, timeout=30
        )
        assert r.status_code == 200, r.text[:300]
        assert r.headers["x-pulsegate-backend"] == "vllm-a"
        assert len(r.json()["choices"]) == 2
