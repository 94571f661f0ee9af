"""The Responses dialect (`proxy/dialects/responses.py`): a stream cut anywhere and continued
reads as one uninterrupted stream. Pure: the sim's framer makes the events, no sockets."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.proxy.dialects import Responses, for_api
from pulsegate.proxy.sse import SSEParser
from pulsegate.sim.text import generate
from pulsegate.sim.typed import ResponsesFramer, TypedApis, TypedRequest

PROMPT = 7  # the request's input tokens as the sim counts them


def _req(n: int, prompt: int) -> TypedRequest:
    return TypedRequest(kind="chat", model="m", context="x", rendered="x", prompt_tokens=prompt,
                        max_tokens=n, stream=True, include_usage=False, seed=None)  # fmt: skip


def _events(raw: bytes) -> list[tuple[bytes | None, dict[str, Any]]]:
    return [(e.name, orjson.loads(e.data)) for e in SSEParser().feed(raw) if e.data]


def _stream(words: list[str], prompt: int) -> list[tuple[bytes | None, dict[str, Any]]]:
    """One engine's whole stream for `words`, as the sim frames it."""
    f = ResponsesFramer("m", 1, _req(len(words), prompt), TypedApis("m"))
    raw = f.first() + b"".join(f.token(w) for w in words) + f.end(prompt, len(words))
    return _events(raw)


def _resumed(n: int, cut: int) -> tuple[list[dict[str, Any]], Responses, list[dict[str, Any]]]:
    """The client's events when the first engine's stream breaks after `cut` events and a
    second engine continues it; also the uninterrupted stream."""
    words = generate("a question", 0, n)
    whole = [o for _, o in _stream(words, PROMPT)]
    d = Responses()
    seen: list[dict[str, Any]] = []
    for _, obj in _stream(words, PROMPT)[:cut]:
        d.track(obj)
        seen.append(orjson.loads(orjson.dumps(obj)))
    k = d.state.tokens
    d.state.tokens_before = k
    for name, obj in _stream(words[k:], PROMPT + k):
        out = d.rewrite(obj)
        if out is not None:
            (ev,) = SSEParser().feed(out)
            got = orjson.loads(ev.data)  # type: ignore[arg-type]
            assert ev.name == name == got["type"].encode()
            seen.append(got)
    return seen, d, whole


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_a_stream_cut_anywhere_reads_as_one_stream(n: int, data: st.DataObject) -> None:
    """Same event types in the same order as one engine's stream, one created, one terminal,
    one response and item id, sequence numbers 0, 1, 2 ..., whole text, usage counted once."""
    cut = data.draw(st.integers(1, n + 3), label="events before the break")  # mid-generation
    seen, d, whole = _resumed(n, cut)
    assert [e["type"] for e in seen] == [e["type"] for e in whole]
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    rid = seen[0]["response"]["id"]
    done = seen[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed"
    items = {e["item_id"] for e in seen if "item_id" in e}
    items |= {e["item"]["id"] for e in seen if "item" in e}
    assert items == {done["output"][0]["id"]}
    text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
    assert text == whole[-1]["response"]["output"][0]["content"][0]["text"]
    assert done["output"][0]["content"][0]["text"] == text
    assert next(e for e in seen if e["type"] == "response.output_text.done")["text"] == text
    assert done["usage"]["input_tokens"] == PROMPT and done["usage"]["output_tokens"] == n
    assert done["usage"]["total_tokens"] == PROMPT + n
    assert d.state.done


def test_the_continuation_asks_for_the_rest_after_an_assistant_item() -> None:
    """Input becomes a list ending with the text sent as an incomplete assistant message
    (vLLM continues it), store off, max_output_tokens reduced; the client's doc untouched."""
    d = Responses()
    for _, obj in _stream(["a", " b", " c"], PROMPT)[:6]:  # created ... two deltas
        d.track(obj)
    doc = {"model": "m", "input": "q", "max_output_tokens": 10, "stream": True}
    body = orjson.loads(d.body(doc))
    part = {"type": "output_text", "text": "a b", "annotations": []}
    sent = {"type": "message", "role": "assistant", "status": "incomplete",
            "id": d.state.item_id, "content": [part]}  # fmt: skip
    assert body["input"] == [{"role": "user", "content": "q"}, sent]
    assert body["store"] is False and body["max_output_tokens"] == 8
    assert doc["input"] == "q" and d.remaining(doc) == 8
    listed = {"model": "m", "input": [{"role": "user", "content": "q"}]}
    assert len(orjson.loads(d.body(listed))["input"]) == 2


def test_what_cannot_be_resumed_says_why() -> None:
    """Function calls, reasoning, previous_response_id, background and structured output
    are refused; a plain request is not."""
    doc: dict[str, Any] = {"model": "m", "input": "q"}
    assert Responses().refusal(doc) is None
    for key, value, why in (
        ("previous_response_id", "resp_1", "previous_response_id"),
        ("background", True, "background"),
        ("text", {"format": {"type": "json_schema"}}, "structured output"),
        ("structured_outputs", {"json": {}}, "constrained"),
        ("input", 3, "input"),
    ):
        assert why in (Responses().refusal({**doc, key: value}) or ""), key
    for item, why in (({"type": "function_call", "id": "fc"}, "function call"),
                      ({"type": "reasoning", "id": "rs"}, "reasoning")):  # fmt: skip
        d = Responses()
        d.track({"type": "response.output_item.added", "output_index": 0, "item": item,
                 "sequence_number": 2})  # fmt: skip
        assert why in (d.refusal(doc) or "")


def test_an_unresumable_stream_ends_with_response_failed_after_the_last_sequence_number() -> None:
    """After `response.created`: `response.failed` with the same id, the message, the next
    sequence number; before it: an `error` event."""
    d = Responses()
    for _, obj in _stream(["a", " b"], PROMPT)[:5]:
        d.track(obj)
    (ev,) = SSEParser().feed(d.error("stream from b1 broken; a function call was in flight"))
    got = orjson.loads(ev.data)  # type: ignore[arg-type]
    assert ev.name == b"response.failed" and got["sequence_number"] == 5
    assert got["response"]["status"] == "failed" and got["response"]["id"].startswith("resp_")
    assert "function call" in got["response"]["error"]["message"]
    (early,) = SSEParser().feed(Responses().error("broken"))
    assert early.name == b"error" and orjson.loads(early.data)["message"] == "broken"  # type: ignore[arg-type]


def test_a_generation_that_ended_gets_its_lost_terminal_event() -> None:
    """Broken after the item was done: `response.completed` alone; budget spent mid-text:
    the `.done` events, then `response.incomplete` (max_output_tokens)."""
    events = _stream(["a", " b"], PROMPT)
    d = Responses()
    for _, obj in events[:-1]:  # everything but response.completed
        d.track(obj)
    assert d.ended()
    (ev,) = SSEParser().feed(d.finish())
    got = orjson.loads(ev.data)  # type: ignore[arg-type]
    assert got["type"] == "response.completed" and got["sequence_number"] == len(events) - 1
    assert got["response"]["output"][0]["content"][0]["text"] == "a b"

    spent = Responses()
    for _, obj in events[:6]:
        spent.track(obj)
    assert not spent.ended()
    types = [e.name for e in SSEParser().feed(spent.finish())]
    assert types == [b"response.output_text.done", b"response.content_part.done",
                     b"response.output_item.done", b"response.incomplete"]  # fmt: skip


def test_the_dialect_is_chosen_by_api_and_learns_the_response_id() -> None:
    """`for_api` makes a Responses dialect that reports the id of `response.created`."""
    learned: list[str] = []
    d = for_api("responses", "/v1/responses", {}, learned.append)
    d.track(_stream(["a"], PROMPT)[0][1])
    assert learned == [d.state.id] and learned[0].startswith("resp_")
