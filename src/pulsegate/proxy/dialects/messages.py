"""The Anthropic Messages dialect: a broken `/v1/messages` stream continued in its own framing.

A Messages stream: `message_start` (the message id, model, input tokens), then per content
block `content_block_start` / `content_block_delta` (`text_delta`) ... / `content_block_stop`
with an `index`, `ping` at any time, `message_delta` (`stop_reason`, usage) and exactly one
`message_stop`. The client must see one `message_start`, one message id, block indexes that
count up without gaps or repeats, and one `message_stop`.

On a vLLM target (`resume: vllm`) the continuation goes through that backend's
`/v1/chat/completions` with `continue_final_message` (`messages_chat.py` says why and how the
conversation is translated): vLLM's `/v1/messages` starts a new turn after a final assistant
message. Its chat chunks become Anthropic events here: each text piece a
`content_block_delta` on the block the client has open (or a new text block at the next
index), `finish_reason` the `stop_reason` (stop: `end_turn`, or `stop_sequence` with the stop
string vLLM reports; length: `max_tokens`), the usage chunk the open block's stop and the one
`message_delta` with the usage of both parts, `[DONE]` (answered by `finish`) `message_stop`.

Otherwise (another resume kind, or a conversation chat cannot carry: images, tool blocks,
`tools`, thinking) the continuation is the same `/v1/messages` request with the text already
sent as a final assistant message: in Anthropic's API a final assistant turn is a prefill by
definition, the model continues it (a client's own prefill gets the text appended). Either
way `max_tokens` shrinks by the tokens sent. That continuation's `message_start` is dropped;
its text block merges into the block the client has open (or takes the next index); its
`message_delta` usage counts the replayed text once.

Never resumed: a `tool_use` block or a `thinking` block seen, structured output
(`output_format`, `output_config.format`). Those end with Anthropic's `event: error`
(`{"type": "error", "error": {"type": "api_error", ...}}`), which the SDK raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from pulsegate.proxy.dialects.base import (
    Continuation,
    StreamState,
    merged_counts,
    remaining_of,
    sse_event,
)
from pulsegate.proxy.dialects.messages_chat import CHAT_PATH, STOP_REASONS, chat_body

_CONSTRAINED = ("output_format", "structured_outputs", "guided_json", "guided_regex")
_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
_THINKING = frozenset({"thinking", "redacted_thinking"})


@dataclass(slots=True)
class MessagesState(StreamState):
    block: int | None = None  # the index of the text block the client has open
    next_index: int = 0  # the index the next new content block gets
    # A continuation's block index -> the client's index.
    index_map: dict[int, int] = field(default_factory=dict)
    reasoning: bool = False
    via_chat: bool = False  # the current continuation speaks chat chunks (vLLM)
    delta_sent: bool = False  # the client has its `message_delta`
    # The end a chat continuation reported, for the `message_delta` still to come.
    stop_reason: str | None = None
    stop_sequence: str | None = None


class Messages:
    """The Messages dialect for one stream."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = MessagesState()

    def track(self, obj: dict[str, Any]) -> None:
        st = self.state
        t = obj.get("type")
        if t == "content_block_delta":
            _delta(st, obj)
        elif t == "message_start":
            msg = obj.get("message")
            if isinstance(msg, dict):
                st.id, st.model = msg.get("id"), msg.get("model")
        elif t == "content_block_start":
            idx = obj.get("index")
            if isinstance(idx, int):
                _started(st, obj, idx)
        elif t == "content_block_stop":
            if obj.get("index") == st.block:
                st.block = None
        elif t == "message_delta":
            st.finished = st.delta_sent = True
        elif t in ("message_stop", "error"):
            st.done = True

    def rewrite(self, obj: dict[str, Any]) -> bytes | None:
        st = self.state
        if st.via_chat:
            return self._from_chat(obj)
        t = obj.get("type")
        if not isinstance(t, str) or t == "message_start":
            return None
        idx = obj.get("index")
        if t == "content_block_start" and isinstance(idx, int):
            block = obj.get("content_block")
            if _kind(block) == "text" and st.block is not None:
                st.index_map[idx] = st.block  # the text goes on in the client's open block
                return None
            st.index_map[idx] = st.next_index
            obj["index"] = st.next_index
            _started(st, obj, st.next_index)
        elif isinstance(idx, int):
            obj["index"] = st.index_map.get(idx, idx)
            if t == "content_block_delta":
                _delta(st, obj)
            elif t == "content_block_stop" and obj["index"] == st.block:
                st.block = None
        elif t == "message_delta":
            st.finished = st.delta_sent = True
            usage = obj.get("usage")
            if isinstance(usage, dict):
                obj["usage"] = _merged(st, usage)
        elif t in ("message_stop", "error"):
            st.done = True
        return sse_event(t, obj)

    def refusal(self, doc: dict[str, Any]) -> str | None:
        st = self.state
        if st.tool_call:
            return "a tool_use block was in flight"
        if st.reasoning:
            return "a thinking block cannot be resumed"
        for key in _CONSTRAINED:
            if doc.get(key) is not None:
                return f"structured output ({key}) cannot be resumed"
        oc = doc.get("output_config")
        if isinstance(oc, dict) and oc.get("format") is not None:
            return "structured output (output_config.format) cannot be resumed"
        if not isinstance(doc.get("messages"), list) or not doc["messages"]:
            return "only a list of messages can be resumed"
        return None

    def remaining(self, doc: dict[str, Any]) -> int | None:
        return remaining_of(doc, self.state, "max_tokens")

    def continuation(self, doc: dict[str, Any], resume: str) -> Continuation:
        """Through vLLM's chat endpoint when the target is vLLM and the conversation
        translates (`messages_chat.chat_body`), else the `/v1/messages` prefill (`body`)."""
        st = self.state
        chat = None
        if resume == "vllm":
            chat = chat_body(doc, st.sent_text(0), self.remaining(doc))
        st.via_chat = chat is not None
        if chat is not None:
            return Continuation(chat, CHAT_PATH)
        return Continuation(self.body(doc))

    def body(self, doc: dict[str, Any]) -> bytes:
        new = dict(doc)
        text = self.state.sent_text(0)
        left = self.remaining(doc)
        msgs = list(doc["messages"])
        last = msgs[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            given = last.get("content")  # the client's own prefill: the text sent follows it
            if isinstance(given, str):
                msgs[-1] = {**last, "content": given + text}
            elif isinstance(given, list):
                msgs[-1] = {**last, "content": [*given, {"type": "text", "text": text}]}
        else:
            msgs.append({"role": "assistant", "content": text})
        new["messages"] = msgs
        if left is not None:
            new["max_tokens"] = max(1, left)
        return orjson.dumps(new)

    def _from_chat(self, obj: dict[str, Any]) -> bytes | None:
        """The Anthropic events of one chat chunk of a continuation (None: nothing to send).
        A chunk that is misshapen raises (the relay's `_MISSHAPEN`: the stream is broken)."""
        st = self.state
        err = obj.get("error")
        if err is not None:  # vLLM's mid-stream error chunk
            msg = err.get("message") if isinstance(err, dict) else None
            return self.error(msg if isinstance(msg, str) else "the continuation failed")
        parts: list[bytes] = []
        choices = obj.get("choices")
        if choices:
            choice = choices[0]
            piece = (choice.get("delta") or {}).get("content")
            if isinstance(piece, str) and piece:
                if st.block is None:  # the client's block was stopped, or never started
                    idx = st.next_index
                    start = {"type": "content_block_start", "index": idx,
                             "content_block": {"type": "text", "text": ""}}  # fmt: skip
                    _started(st, start, idx)
                    parts.append(sse_event("content_block_start", start))
                ev = {"type": "content_block_delta", "index": st.block,
                      "delta": {"type": "text_delta", "text": piece}}  # fmt: skip
                _delta(st, ev)
                parts.append(sse_event("content_block_delta", ev))
            reason = choice.get("finish_reason")
            if reason is not None:
                st.finished = True
                st.stop_reason = STOP_REASONS.get(reason, "end_turn")
                matched = choice.get("stop_reason")  # vLLM: the stop string that matched
                if reason == "stop" and isinstance(matched, str):
                    st.stop_reason, st.stop_sequence = "stop_sequence", matched
        usage = obj.get("usage")
        if not choices and isinstance(usage, dict) and not st.delta_sent:
            p, c = merged_counts(
                st.tokens_before, usage.get("prompt_tokens"), usage.get("completion_tokens")
            )
            parts.append(self._closing({"input_tokens": p, "output_tokens": c}))
        return b"".join(parts) if parts else None

    def _closing(self, usage: dict[str, Any]) -> bytes:
        """The open block's stop and the one `message_delta`: the stop reason the
        continuation gave, else `max_tokens` (the budget ran out at the seam)."""
        st = self.state
        parts: list[bytes] = []
        if st.block is not None:
            parts.append(
                sse_event("content_block_stop", {"type": "content_block_stop", "index": st.block})
            )
            st.block = None
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": st.stop_reason or "max_tokens",
                "stop_sequence": st.stop_sequence,
            },
            "usage": usage,
        }
        parts.append(sse_event("message_delta", delta))
        st.finished = st.delta_sent = True
        return b"".join(parts)

    def ended(self) -> bool:
        return self.state.finished

    def finish(self) -> bytes:
        """What the client has not seen of a generation that is over: the open block's stop,
        `message_delta` (a chat continuation's stop reason, else `max_tokens`: the budget ran
        out at the seam) and `message_stop`. Also a chat continuation's answer to `[DONE]`."""
        st = self.state
        parts: list[bytes] = []
        if not st.delta_sent:
            parts.append(self._closing({"output_tokens": st.tokens}))
        elif st.block is not None:
            parts.append(
                sse_event("content_block_stop", {"type": "content_block_stop", "index": st.block})
            )
            st.block = None
        parts.append(sse_event("message_stop", {"type": "message_stop"}))
        st.done = True
        return b"".join(parts)

    def error(self, message: str) -> bytes:
        self.state.done = True
        err = {"type": "error", "error": {"type": "api_error", "message": message}}
        return sse_event("error", err)


def _kind(block: object) -> object:
    return block.get("type") if isinstance(block, dict) else None


def _started(st: MessagesState, obj: dict[str, Any], idx: int) -> None:
    kind = _kind(obj.get("content_block"))
    if kind == "text":
        st.block = idx
    elif kind in _TOOL_BLOCKS:
        st.tool_call = True
    elif kind in _THINKING:
        st.reasoning = True
    st.next_index = max(st.next_index, idx + 1)


def _delta(st: MessagesState, obj: dict[str, Any]) -> None:
    delta = obj.get("delta")
    kind = _kind(delta)
    if kind == "text_delta":
        piece = delta.get("text")  # type: ignore[union-attr]
        if isinstance(piece, str) and piece:
            st.text.setdefault(0, []).append(piece)
            st.tokens += 1
    elif kind == "input_json_delta":
        st.tool_call = True
    elif kind in ("thinking_delta", "signature_delta"):
        st.reasoning = True


def _merged(st: MessagesState, usage: dict[str, Any]) -> dict[str, Any]:
    """The final usage of both parts: the replayed text is output, counted once."""
    p, c = merged_counts(st.tokens_before, usage.get("input_tokens"), usage.get("output_tokens"))
    out = {**usage, "output_tokens": c}
    if isinstance(usage.get("input_tokens"), int):
        out["input_tokens"] = p
    return out
