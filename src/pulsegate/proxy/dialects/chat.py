"""The chat/completions dialect: today's resume logic, one module (behaviour unchanged).

`/v1/completions` continues with `prompt` + the text already sent; `/v1/chat/completions`
with an assistant message holding it and vLLM's `continue_final_message`. A continuation's
chunks wear the first stream's id, created and model, minus the role preamble; usage is merged
so the replayed text counts once. The relay keeps its own chat pump (stop strings, the OpenAI
way of `usage`, `[DONE]`) and calls these for the rest.
"""

from __future__ import annotations

from typing import Any

import orjson

from pulsegate.proxy.dialects.base import Continuation, StreamState
from pulsegate.proxy.errors import sse_error_event
from pulsegate.proxy.request import CHAT

_DONE = b"data: [DONE]\n\n"

# Request fields that constrain decoding: replaying text into them corrupts the output.
_CONSTRAINED = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "grammar",
    "json_schema",
)


def resume_refusal(doc: dict[str, Any], state: StreamState) -> str | None:
    """Why this stream must not be continued elsewhere, or None if it may."""
    n = doc.get("n")
    if isinstance(n, int) and n > 1:
        return "n > 1 cannot be resumed"
    if state.tool_call:
        return "a tool call was in flight"
    for key in _CONSTRAINED:
        if doc.get(key) is not None:
            return f"constrained decoding ({key}) cannot be resumed"
    if "prompt" in doc and not isinstance(doc["prompt"], str):
        return "only a single string prompt can be resumed"
    return None


def resume_body(doc: dict[str, Any], path: str, state: StreamState) -> bytes:
    """The request that continues the generation from what the client already has."""
    new = dict(doc)
    text = state.sent_text(0)
    if path == CHAT:
        new["messages"] = [*doc["messages"], {"role": "assistant", "content": text}]
        new["continue_final_message"] = True
        new["add_generation_prompt"] = False
    else:
        new["prompt"] = doc["prompt"] + text
    for key in ("max_tokens", "max_completion_tokens"):
        v = doc.get(key)
        if isinstance(v, int) and not isinstance(v, bool):  # `true` is no budget
            new[key] = max(1, v - state.tokens)
    return orjson.dumps(new)


def remaining_tokens(doc: dict[str, Any], state: StreamState) -> int | None:
    v = doc.get("max_completion_tokens", doc.get("max_tokens"))
    return v - state.tokens if isinstance(v, int) and not isinstance(v, bool) else None


def track(state: StreamState, obj: dict[str, Any]) -> None:
    """Note what one chunk of the first (pass-through) upstream tells the client."""
    if state.id is None:
        state.id = obj.get("id")
        state.created = obj.get("created")
        state.model = obj.get("model")
    _track_choices(state, obj)


def _track_choices(state: StreamState, obj: dict[str, Any]) -> None:
    choices = obj.get("choices")
    if not choices:
        return
    for ch in choices:
        idx = ch.get("index", 0)
        delta = ch.get("delta")
        piece = delta.get("content") if delta is not None else ch.get("text")
        if delta is not None and delta.get("tool_calls"):
            state.tool_call = True
        if piece:
            state.text.setdefault(idx, []).append(piece)
            state.tokens += 1
        if ch.get("finish_reason"):
            state.finished = True


def rewrite(state: StreamState, obj: dict[str, Any], include_usage: bool) -> bytes | None:
    """A chunk of a resumed upstream, made to look like the first stream's.

    Returns the event bytes to send, or None to drop the chunk (the role preamble of a
    continued chat, or a usage chunk that is re-sent merged at the end)."""
    choices = obj.get("choices")
    if not choices:
        if obj.get("usage") is not None:
            if include_usage:
                obj["usage"] = _merge_usage(state, obj["usage"])
                _stamp(state, obj)
                return b"data: " + orjson.dumps(obj) + b"\n\n"
            return None
        return None
    ch = choices[0]
    delta = ch.get("delta")
    if delta is not None:
        # The continuation's opening chunk repeats the role with empty content: drop it.
        if delta.get("role") and not delta.get("content") and not ch.get("finish_reason"):
            return None
        delta.pop("role", None)
    _track_choices(state, obj)
    if "usage" in obj and obj["usage"] is not None:
        obj["usage"] = _merge_usage(state, obj["usage"])
    _stamp(state, obj)
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _stamp(state: StreamState, obj: dict[str, Any]) -> None:
    if state.id is not None:
        obj["id"] = state.id
    if state.created is not None:
        obj["created"] = state.created
    if state.model is not None:
        obj["model"] = state.model


def _merge_usage(state: StreamState, usage: dict[str, Any]) -> dict[str, Any]:
    """Usage of the whole stream: the continuation counted the replayed text as prompt."""
    before = state.tokens_before
    completion = int(usage.get("completion_tokens") or 0) + before
    prompt = usage.get("prompt_tokens")
    prompt = max(0, prompt - before) if isinstance(prompt, int) else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_chunk(state: StreamState, path: str, reason: str = "length") -> bytes:
    """A closing chunk for a stream whose token budget was spent at the seam."""
    if path == CHAT:
        choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": reason}
        obj_type = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": "", "finish_reason": reason}
        obj_type = "text_completion"
    obj = {"object": obj_type, "choices": [choice]}
    _stamp(state, obj)
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Chat:
    """The chat/completions dialect for one stream at `path`."""

    __slots__ = ("include_usage", "path", "state")

    def __init__(self, path: str, include_usage: bool) -> None:
        self.path = path
        self.include_usage = include_usage
        self.state = StreamState()

    def track(self, obj: dict[str, Any]) -> None:
        track(self.state, obj)

    def rewrite(self, obj: dict[str, Any]) -> bytes | None:
        return rewrite(self.state, obj, self.include_usage)

    def refusal(self, doc: dict[str, Any]) -> str | None:
        return resume_refusal(doc, self.state)

    def remaining(self, doc: dict[str, Any]) -> int | None:
        return remaining_tokens(doc, self.state)

    def body(self, doc: dict[str, Any]) -> bytes:
        return resume_body(doc, self.path, self.state)

    def continuation(self, doc: dict[str, Any], resume: str) -> Continuation:
        return Continuation(self.body(doc))

    def ended(self) -> bool:
        return False  # a finish_reason then a break: continued, as before the dialects

    def finish(self) -> bytes:
        return finish_chunk(self.state, self.path) + _DONE

    def error(self, message: str) -> bytes:
        return sse_error_event(502, message, "upstream_stream_broken") + _DONE
