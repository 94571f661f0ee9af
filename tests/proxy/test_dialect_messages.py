"""The Anthropic Messages dialect (`proxy/dialects/messages.py`): a stream cut anywhere and
continued reads as one uninterrupted stream. Pure: the sim's framer makes the events."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.proxy.dialects import Messages, for_api
from pulsegate.proxy.sse import SSEParser
from pulsegate.sim.protocol import Framer, parse_chat
from pulsegate.sim.text import generate
from pulsegate.sim.typed import MessagesFramer, TypedApis, TypedRequest

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


def _chat(words: list[str], prompt: int, reason: str) -> list[dict[str, Any]]:
    """A vLLM chat stream of `words` with include_usage (the sim's framer), `[DONE]` left
    out (the relay answers it with `finish`)."""
    f = Framer("chat", "m", 1)
    last = len(words) - 1
    toks = [f.token(w, reason if i == last else None) for i, w in enumerate(words)]
    raw = f.first() + b"".join(toks) + f.usage(prompt, len(words))
    return [orjson.loads(e.data) for e in SSEParser().feed(raw) if e.data]  # type: ignore[arg-type]


def _feed(d: Messages, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    for obj in chunks:
        out = d.rewrite(obj)
        if out is not None:
            got += [orjson.loads(e.data) for e in SSEParser().feed(out)]  # type: ignore[arg-type]
    return got + [orjson.loads(e.data) for e in SSEParser().feed(d.finish())]  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 12), reason=st.sampled_from(["length", "stop"]), data=st.data())
def test_a_stream_continued_through_vllm_chat_reads_as_one_messages_stream(
    n: int, reason: str, data: st.DataObject
) -> None:
    """Cut anywhere before the last token and continued in chat chunks: the events the
    client gets are the uninterrupted stream's (one block 0, the whole text, one
    message_delta with stop_reason mapped and usage of one engine, one message_stop)."""
    words = generate("a question", 3, n)
    first = _stream(words, PROMPT)
    cut = data.draw(st.integers(1, n + 1), label="events before the break")
    d = Messages()
    seen: list[dict[str, Any]] = []
    for _, obj in first[:cut]:
        d.track(obj)
        seen.append(obj)
    k = d.state.tokens
    doc = {"model": "m", "max_tokens": n, "messages": [{"role": "user", "content": "q"}]}
    assert d.continuation(doc, "vllm").path == "/v1/chat/completions"
    d.state.tokens_before = k
    seen += _feed(d, _chat(words[k:], PROMPT + k, reason))
    assert [e["type"] for e in seen] == [e["type"] for _, e in first]
    assert {e["index"] for e in seen if e["type"].startswith("content_block")} == {0}
    text = "".join(e["delta"]["text"] for e in seen if e["type"] == "content_block_delta")
    assert text == "".join(words)
    (delta,) = [e for e in seen if e["type"] == "message_delta"]
    assert delta["usage"] == {"input_tokens": PROMPT, "output_tokens": n}
    want = {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert delta["delta"] == {"stop_reason": want, "stop_sequence": None} and d.state.done


def test_chat_text_after_a_closed_block_takes_the_next_index_and_its_stop_string() -> None:
    """The client's block was stopped: the chat text opens block 1; a stop string vLLM
    reports (`stop_reason`) becomes `stop_sequence`; message_stop comes once, at [DONE]."""
    d = Messages()
    for _, obj in _stream(["a"], PROMPT)[:2]:
        d.track(obj)
    d.track({"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "a"}})  # fmt: skip
    d.track({"type": "content_block_stop", "index": 0})
    d.continuation(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "q"}]}, "vllm"
    )
    chunks = _chat([" b", " c"], PROMPT + 1, "stop")
    chunks[-2]["choices"][0]["stop_reason"] = "END"
    got = _feed(d, chunks)
    assert [(e["type"], e.get("index")) for e in got] == [
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]  # fmt: skip
    assert got[4]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert d.state.sent_text(0) == "a b c"


def test_a_vllm_continuation_is_the_conversation_in_chat_continuing_the_text_sent() -> None:
    """System blocks joined, text blocks as text parts (empty dropped, one as a string),
    the sent text after the client's prefill, continue_final_message, the budget left,
    sampling carried, stop_sequences as stop, usage asked for; the client's doc untouched."""
    d = Messages()
    for _, obj in _stream(["a", " b", " c"], PROMPT)[:4]:
        d.track(obj)
    blocks = [{"type": "text", "text": "one"}, {"type": "text", "text": ""},
              {"type": "text", "text": "two", "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    doc = {"model": "m", "max_tokens": 10, "temperature": 0, "top_p": 0.9, "top_k": 5,
           "stop_sequences": ["END"], "metadata": {"user_id": "u"},
           "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
           "messages": [{"role": "user", "content": blocks},
                        {"role": "assistant", "content": [{"type": "text", "text": "Sure:"}]},
                        {"role": "user", "content": [{"type": "text", "text": "go"}]}]}  # fmt: skip
    before = orjson.dumps(doc)
    cont = d.continuation(doc, "vllm")
    assert cont.path == "/v1/chat/completions" and orjson.dumps(doc) == before
    assert orjson.loads(cont.body) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one"},
                                         {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "Sure:"},
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "a b"},
        ],
        "continue_final_message": True, "add_generation_prompt": False,
        "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 8, "temperature": 0, "top_p": 0.9, "top_k": 5, "stop": ["END"],
    }  # fmt: skip
    prefill = {**doc, "messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "Sure:"}]}  # fmt: skip
    msgs = orjson.loads(d.continuation(prefill, "vllm").body)["messages"]
    assert msgs[-1] == {"role": "assistant", "content": "Sure:a b"} and len(msgs) == 3


def test_what_chat_cannot_carry_keeps_the_messages_prefill() -> None:
    """Image, tool_use and tool_result blocks, tools, enabled thinking, or a target that is
    not vLLM: the continuation stays a `/v1/messages` prefill and its events are typed."""
    q = {"role": "user", "content": "q"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
    base: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": [q]}
    docs: list[tuple[dict[str, Any], str]] = [
        ({**base, "messages": [{"role": "user", "content": [image]}]}, "vllm"),
        ({**base, "messages": [q, {"role": "assistant", "content": [use]},
                               {"role": "user", "content": [result]}]}, "vllm"),
        ({**base, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "vllm"),
        ({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "vllm"),
        (base, "none"),
    ]  # fmt: skip
    for doc, resume in docs:
        d = Messages()
        for _, obj in _stream(["a", " b"], PROMPT)[:3]:
            d.track(obj)
        cont = d.continuation(doc, resume)
        assert cont.path is None, doc
        assert orjson.loads(cont.body)["messages"][-1] == {"role": "assistant", "content": "a"}
        assert not d.state.via_chat
    d = Messages()
    d.continuation({**base, "thinking": {"type": "disabled"}}, "vllm")
    assert d.state.via_chat


def test_a_chat_error_chunk_ends_with_anthropics_error_event() -> None:
    """vLLM's mid-stream `{"error": ...}` chunk becomes Anthropic's `api_error` event."""
    d = Messages()
    d.continuation(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "q"}]}, "vllm"
    )
    assert d.state.via_chat
    out = d.rewrite({"error": {"object": "error", "message": "engine died", "code": 500}})
    (ev,) = SSEParser().feed(out or b"")
    assert ev.name == b"error" and d.state.done
    assert orjson.loads(ev.data)["error"] == {"type": "api_error", "message": "engine died"}  # type: ignore[arg-type]


def test_the_sim_continues_the_chat_translation_as_it_continues_the_prefill() -> None:
    """The sim parses the chat continuation and the `/v1/messages` prefill of one stream to
    the same context, seed, prompt and budget: the same text after the seam either way."""
    d = Messages()
    for _, obj in _stream(["a", " b", " c"], PROMPT)[:4]:
        d.track(obj)
    doc = {"model": "m", "max_tokens": 10, "seed": 7, "system": "Be brief.",
           "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]}  # fmt: skip
    chat = parse_chat(d.continuation(doc, "vllm").body)
    prefill = TypedApis("m").parse_messages(d.continuation(doc, "none").body)
    assert chat.context == prefill.context and chat.context.endswith("q a b")
    assert (chat.seed, chat.prompt_tokens, chat.max_tokens) == (
        prefill.seed, prefill.prompt_tokens, prefill.max_tokens)  # fmt: skip
    assert chat.include_usage and chat.stream
