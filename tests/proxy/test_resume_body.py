"""The continuation of a broken stream (`proxy/resume.py`): body, rewrite, usage. Pure."""

from __future__ import annotations

import orjson

from pulsegate.proxy.request import CHAT, COMPLETIONS
from pulsegate.proxy.resume import (
    StreamState,
    finish_chunk,
    remaining_tokens,
    resume_body,
    resume_refusal,
    rewrite,
    token_count,
    track,
)


def _sent(path: str, pieces: list[str]) -> StreamState:
    state = StreamState()
    for i, p in enumerate(pieces):
        if path == CHAT:
            ch = {"index": 0, "delta": {"content": p}, "finish_reason": None}
        else:
            ch = {"index": 0, "text": p, "finish_reason": None}
        track(state, {"id": "first", "created": 7, "model": "m", "choices": [ch], "n": i})
    return state


def test_a_chat_continues_from_the_text_sent_with_fewer_tokens() -> None:
    """The sent text becomes a final assistant message; max_tokens shrinks by the tokens sent."""
    doc = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10}
    state = _sent(CHAT, ["Hel", "lo"])
    body = orjson.loads(resume_body(doc, CHAT, state))
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8
    assert doc["messages"] == [{"role": "user", "content": "q"}]  # the client's doc untouched
    assert remaining_tokens(doc, state) == 8


def test_a_completion_continues_with_the_text_appended_to_the_prompt() -> None:
    """Completions: prompt + text sent; max_tokens never below 1."""
    doc = {"model": "m", "prompt": "Once", "max_tokens": 2}
    state = _sent(COMPLETIONS, [" upon", " a", " time"])
    body = orjson.loads(resume_body(doc, COMPLETIONS, state))
    assert body["prompt"] == "Once upon a time" and body["max_tokens"] == 1


def test_what_cannot_be_resumed_says_why() -> None:
    """n > 1, a tool call in flight, constrained decoding, a list prompt."""
    state = StreamState()
    assert resume_refusal({"n": 2}, state) == "n > 1 cannot be resumed"
    assert "response_format" in str(resume_refusal({"response_format": {"type": "json"}}, state))
    assert resume_refusal({"prompt": ["a", "b"]}, state) is not None
    track(state, {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]}}]})
    assert resume_refusal({}, state) == "a tool call was in flight"
    assert resume_refusal({"messages": []}, StreamState()) is None


def test_a_continuation_chunk_wears_the_first_streams_id_and_drops_its_role_preamble() -> None:
    """id, created and model are the first stream's; the repeated role chunk is dropped."""
    state = _sent(CHAT, ["a"])
    preamble = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    assert rewrite(state, preamble, include_usage=False) is None
    chunk = {"id": "x", "created": 9, "model": "other", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "b"}, "finish_reason": None}
    ]}  # fmt: skip
    out = orjson.loads(rewrite(state, chunk, include_usage=False)[6:])  # type: ignore[index]
    assert (out["id"], out["created"], out["model"]) == ("first", 7, "m")
    assert "role" not in out["choices"][0]["delta"]
    assert state.sent_text(0) == "ab"


def test_usage_is_merged_across_the_seam() -> None:
    """The continuation counted the replayed text as prompt: it moves back to completion."""
    state = _sent(CHAT, ["a", "b", "c"])
    state.tokens_before = 3
    usage = {"choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 4}}
    out = orjson.loads(rewrite(state, usage, include_usage=True)[6:])  # type: ignore[index]
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    assert out["id"] == "first"
    assert rewrite(state, dict(usage), include_usage=False) is None  # not asked: dropped


def test_finish_chunk_and_token_count() -> None:
    """A budget spent at the seam ends with finish_reason length; /tokenize answers counted."""
    state = _sent(COMPLETIONS, ["x"])
    end = orjson.loads(finish_chunk(state, COMPLETIONS)[6:])
    assert end["choices"][0]["finish_reason"] == "length" and end["id"] == "first"
    assert token_count(b'{"count": 5, "tokens": [1]}') == 5
    assert token_count(b'{"tokens": [1, 2]}') == 2
    assert token_count(b"not json") is None and token_count(b'{"count": -1}') is None
