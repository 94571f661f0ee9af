"""The Anthropic Messages dialect (`proxy/dialects/messages.py`): a stream cut anywhere and
continued reads as one uninterrupted stream. Pure: the sim's framer makes the events."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.proxy.dialects import Messages, for_api
from pulsegate.proxy.sse import SSEParser
from pulsegate.sim.text import generate
from pulsegate.sim.typed import MessagesFramer, TypedRequest

PROMPT = 5


def _req(n: int, prompt: int) -> TypedRequest:
    return TypedRequest(kind="chat", model="m", context="x", rendered="x", prompt_tokens=prompt,
                        max_tokens=n, stream=True, include_usage=False, seed=None,
                        api="messages")  # fmt: skip


def _events(raw: bytes) -> list[tuple[bytes | None, dict[str, Any]]]:
    return [(e.name, orjson.loads(e.data)) for e in SSEParser().feed(raw) if e.data]


def _stream(words: list[str], prompt: int, ping: bool = False) -> list[tuple[Any, Any]]:
    f = MessagesFramer("m", 1, _req(len(words), prompt))
    pinged = b'event: ping\ndata: {"type":"ping"}\n\n' if ping else b""
    raw = f.first() + pinged + b"".join(f.token(w) for w in words) + f.end(prompt, len(words))
    return _events(raw)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 12), ping=st.booleans(), data=st.data())
def test_a_stream_cut_anywhere_reads_as_one_stream(n: int, ping: bool, data: st.DataObject) -> None:
    """One message_start, one text block at index 0 (started and stopped once), the whole
    text, one message_delta with the usage of one engine, one message_stop."""
    words = generate("a question", 3, n)
    first = _stream(words, PROMPT, ping)
    cut = data.draw(st.integers(1, n + 2), label="events before the break")
    d = Messages()
    seen: list[dict[str, Any]] = []
    for _, obj in first[:cut]:
        d.track(obj)
        seen.append(orjson.loads(orjson.dumps(obj)))
    k = d.state.tokens
    d.state.tokens_before = k
    for name, obj in _stream(words[k:], PROMPT + k, ping):
        out = d.rewrite(obj)
        if out is not None:
            (ev,) = SSEParser().feed(out)
            got = orjson.loads(ev.data)  # type: ignore[arg-type]
            assert ev.name == name
            seen.append(got)
    types = [e["type"] for e in seen if e["type"] != "ping"]
    assert types == [e["type"] for _, e in first if e["type"] != "ping"]
    assert {e["index"] for e in seen if e["type"].startswith("content_block")} == {0}
    text = "".join(e["delta"]["text"] for e in seen if e["type"] == "content_block_delta")
    assert text == "".join(words)
    (delta,) = [e for e in seen if e["type"] == "message_delta"]
    assert delta["usage"] == {"input_tokens": PROMPT, "output_tokens": n}
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert seen[0]["message"]["id"] == first[0][1]["message"]["id"] and d.state.done


def test_a_continuation_after_a_closed_block_takes_the_next_index() -> None:
    """A continuation's text block after the client's block was stopped is block 1, and its
    deltas and stop follow it there."""
    d = Messages()
    for obj in ({"type": "message_start", "message": {"id": "msg_1", "model": "m"}},
                {"type": "content_block_start", "index": 0,
                 "content_block": {"type": "text", "text": ""}},
                {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": "a"}},
                {"type": "content_block_stop", "index": 0}):  # fmt: skip
        d.track(obj)
    d.state.tokens_before = d.state.tokens
    got = []
    for _, obj in _stream([" b"], PROMPT + 1):
        out = d.rewrite(obj)
        if out is not None:
            got += [orjson.loads(e.data) for e in SSEParser().feed(out)]  # type: ignore[arg-type]
    assert [(e["type"], e.get("index")) for e in got] == [
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None)]  # fmt: skip


def test_the_continuation_is_a_prefilled_assistant_turn() -> None:
    """The text sent becomes a final assistant message (a client's own prefill gets it
    appended); max_tokens shrinks by the tokens sent; the client's doc is untouched."""
    d = Messages()
    for _, obj in _stream(["a", " b", " c"], PROMPT)[:4]:  # start, block, two deltas
        d.track(obj)
    doc = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "q"}]}
    body = orjson.loads(d.body(doc))
    assert body["messages"][-1] == {"role": "assistant", "content": "a b"}
    assert body["max_tokens"] == 8 and len(doc["messages"]) == 1
    prefilled = {**doc, "messages": [*doc["messages"], {"role": "assistant", "content": "Sure:"}]}
    assert orjson.loads(d.body(prefilled))["messages"][-1]["content"] == "Sure:a b"
    own = {"role": "assistant", "content": [{"type": "text", "text": "S"}]}
    blocks = {**doc, "messages": [*doc["messages"], own]}
    last = orjson.loads(d.body(blocks))["messages"][-1]["content"]
    assert last == [{"type": "text", "text": "S"}, {"type": "text", "text": "a b"}]


def test_what_cannot_be_resumed_says_why_and_ends_with_anthropics_error_event() -> None:
    """tool_use and thinking blocks, structured output are refused; the error event is
    Anthropic's `api_error` shape."""
    doc: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}
    assert Messages().refusal(doc) is None
    for block, why in (({"type": "tool_use", "id": "t", "name": "f", "input": {}}, "tool_use"),
                       ({"type": "thinking", "thinking": ""}, "thinking")):  # fmt: skip
        d = Messages()
        d.track({"type": "content_block_start", "index": 0, "content_block": block})
        assert why in (d.refusal(doc) or "")
    assert "structured" in (Messages().refusal({**doc, "output_format": {}}) or "")
    oc = {**doc, "output_config": {"format": {"type": "json_schema"}}}
    assert "output_config" in (Messages().refusal(oc) or "")
    (ev,) = SSEParser().feed(Messages().error("stream from b1 broken; no backend left"))
    assert ev.name == b"error"
    assert orjson.loads(ev.data) == {  # type: ignore[arg-type]
        "type": "error",
        "error": {"type": "api_error", "message": "stream from b1 broken; no backend left"},
    }


def test_a_budget_spent_at_the_seam_is_closed_the_anthropic_way() -> None:
    """Every token sent, the stream broke: the open block stops, `message_delta` says
    max_tokens with the tokens sent, then `message_stop`."""
    d = for_api("messages", "/v1/messages", {})
    for _, obj in _stream(["a", " b"], PROMPT)[:4]:
        d.track(obj)
    got = [orjson.loads(e.data) for e in SSEParser().feed(d.finish())]  # type: ignore[arg-type]
    assert [e["type"] for e in got] == ["content_block_stop", "message_delta", "message_stop"]
    assert got[1]["delta"]["stop_reason"] == "max_tokens" and got[1]["usage"]["output_tokens"] == 2
    assert d.state.done
