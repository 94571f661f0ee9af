"""The OpenAI Responses dialect: a broken `/v1/responses` stream continued in its own framing.

A Responses stream is typed events, each `event: TYPE` + JSON with `type` and a strictly
increasing `sequence_number`: `response.created`, `response.in_progress`,
`response.output_item.added` (the assistant message item, id `msg_...`),
`response.content_part.added`, `response.output_text.delta` ..., then `.done` events for the
text, part and item, and exactly one terminal event (`response.completed`, `.incomplete`,
`.failed` or `error`). The client must see one `response.created`, one response id, one item
id, sequence numbers that never repeat, and one terminal event, whichever backends spoke.

The continuation (`body`) asks for the same `input` plus the text already sent as an
assistant output message with `status: "incomplete"`, which vLLM continues rather than
answering anew (its partial-message completion), `store: false` (its id is never shown) and
`max_output_tokens` reduced by the tokens sent. Its opening
events are dropped, the rest renumbered after the last sequence number the client saw and
re-stamped with the first stream's response and item ids; the `.done` events and the
terminal response carry the whole text, and its usage counts the replayed text once.

Never resumed: a function call or a reasoning item seen, `previous_response_id` (that state
lived on the backend that failed), `background`, structured output (`text.format`). Those end
with `response.failed` (or an `error` event before `response.created`): never a silent stop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pulsegate.proxy.dialects.base import (
    Continuation,
    StreamState,
    merged_counts,
    remaining_of,
    sse_event,
)

TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
_OPENING = frozenset({"response.created", "response.queued"})
# Request fields that constrain decoding (vLLM's extensions): replayed text would corrupt it.
_CONSTRAINED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")


@dataclass(slots=True)
class ResponsesState(StreamState):
    response: dict[str, Any] | None = None  # the object `response.created` carried
    seq: int = -1  # the last sequence number the client saw
    item_id: Any = None  # the assistant message item's id, once added
    output_index: int = 0
    content_index: int = 0
    item_added: bool = False
    part_added: bool = False
    text_done: bool = False
    part_done: bool = False
    reasoning: bool = False
    in_progress: bool = False  # `response.in_progress` sent


class Responses:
    """The Responses dialect for one stream."""

    __slots__ = ("learn", "state")

    def __init__(self, learn: Callable[[str], None] | None = None) -> None:
        self.state = ResponsesState()
        self.learn = learn  # told the response id once `response.created` passes

    # -- the first upstream: forwarded as is, noted -----------------------------------------

    def track(self, obj: dict[str, Any]) -> None:
        st = self.state
        seq = obj.get("sequence_number")
        if isinstance(seq, int) and seq > st.seq:
            st.seq = seq
        t = obj.get("type")
        if t == "response.output_text.delta":
            _add_text(st, obj)
        elif t == "response.created":
            resp = obj.get("response")
            if isinstance(resp, dict):
                st.response = resp
                st.id, st.created, st.model = (
                    resp.get("id"),
                    resp.get("created_at"),
                    resp.get("model"),
                )
                if self.learn is not None and isinstance(st.id, str):
                    self.learn(st.id)
        elif t in TERMINAL:
            st.done = True
        else:
            _note(st, t, obj)

    # -- a continuation: made to look like the first stream ---------------------------------

    def rewrite(self, obj: dict[str, Any]) -> bytes | None:
        st = self.state
        t = obj.get("type")
        if not isinstance(t, str) or t in _OPENING:
            return None
        if t == "response.in_progress":
            if st.in_progress or st.response is None:
                return None
            obj["response"] = st.response  # broke right after `response.created`
        if t == "response.output_item.added" and _is_message(obj.get("item")):
            if st.item_added:
                return None  # the first stream's item is open: the text goes on in it
            st.item_id = obj["item"].get("id")  # broke before its item: this one is ours
        elif t == "response.content_part.added" and st.part_added:
            return None
        if t == "response.output_text.delta":
            _add_text(st, obj)
        elif t in TERMINAL:
            st.done = True
            resp = obj.get("response")
            if isinstance(resp, dict):
                obj["response"] = self._whole(resp)
        else:
            _note(st, t, obj)
            self._whole_text(t, obj)
        if "item_id" in obj and st.item_id is not None:
            obj["item_id"] = st.item_id
            obj["content_index"] = st.content_index
        if "output_index" in obj and (_is_message(obj.get("item")) or "item_id" in obj):
            obj["output_index"] = st.output_index
        st.seq += 1
        obj["sequence_number"] = st.seq
        return sse_event(t, obj)

    def _whole_text(self, t: str, obj: dict[str, Any]) -> None:
        """The `.done` events of a continuation carry the whole text, not its part."""
        text = self.state.sent_text(0)
        if t == "response.output_text.done":
            obj["text"] = text
        elif t == "response.content_part.done" and isinstance(obj.get("part"), dict):
            obj["part"]["text"] = text
        elif t == "response.output_item.done" and _is_message(obj.get("item")):
            obj["item"] = self._item(obj["item"], obj["item"].get("status") or "completed")

    def _item(self, item: dict[str, Any] | None, status: str) -> dict[str, Any]:
        st = self.state
        new = dict(item or {"type": "message", "role": "assistant"})
        new["id"], new["status"] = st.item_id, status
        parts = [p for p in new.get("content") or () if isinstance(p, dict)]
        part = dict(parts[0]) if parts else {"type": "output_text", "annotations": []}
        part["text"] = st.sent_text(0)
        new["content"] = [part]
        return new

    def _whole(self, resp: dict[str, Any]) -> dict[str, Any]:
        """A continuation's terminal response as the client's: first ids, whole text, the
        usage of both parts with the replayed text counted once."""
        st = self.state
        out = dict(resp)
        for key, v in (("id", st.id), ("created_at", st.created), ("model", st.model)):
            if v is not None:
                out[key] = v
        items = out.get("output")
        if isinstance(items, list):
            out["output"] = [
                self._item(i, i.get("status") or "completed") if _is_message(i) else i
                for i in items
            ]
        usage = out.get("usage")
        if isinstance(usage, dict):
            p, c = merged_counts(
                st.tokens_before, usage.get("input_tokens"), usage.get("output_tokens")
            )
            out["usage"] = {**usage, "input_tokens": p, "output_tokens": c, "total_tokens": p + c}
            details = usage.get("input_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                # The continuation's cache hit covers the replayed text too (vLLM: 128 cached
                # of 30 input): never more cached than input.
                cached = min(details["cached_tokens"], p)
                out["usage"]["input_tokens_details"] = {**details, "cached_tokens": cached}
        return out

    # -- the continuation request and the ways to end ---------------------------------------

    def refusal(self, doc: dict[str, Any]) -> str | None:
        st = self.state
        if st.tool_call:
            return "a function call was in flight"
        if st.reasoning:
            return "a reasoning item cannot be resumed"
        if doc.get("previous_response_id") is not None:
            return "the previous_response_id state lived on the backend that failed"
        if doc.get("background") is True:
            return "a background response lives on its backend"
        text = doc.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            return f"structured output (text.format {fmt.get('type')}) cannot be resumed"
        for key in _CONSTRAINED:
            if doc.get(key) is not None:
                return f"constrained decoding ({key}) cannot be resumed"
        if not isinstance(doc.get("input"), str | list):
            return "only a string or a list of items as input can be resumed"
        return None

    def remaining(self, doc: dict[str, Any]) -> int | None:
        return remaining_of(doc, self.state, "max_output_tokens")

    def continuation(self, doc: dict[str, Any], resume: str) -> Continuation:
        return Continuation(self.body(doc))

    def body(self, doc: dict[str, Any]) -> bytes:
        new = dict(doc)
        given = doc["input"]
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
        items.append(self._partial())
        new["input"] = items
        new["store"] = False
        left = self.remaining(doc)
        if left is not None:
            new["max_output_tokens"] = max(1, left)
        return orjson.dumps(new)

    def _partial(self) -> dict[str, Any]:
        """The text sent as an unfinished assistant output message: vLLM continues an
        input whose last item is an assistant message with status `in_progress` or
        `incomplete` (`should_continue_final_message`, vLLM 0.32) instead of starting a
        new turn."""
        st = self.state
        part = {"type": "output_text", "text": st.sent_text(0), "annotations": []}
        item: dict[str, Any] = {"type": "message", "role": "assistant", "status": "incomplete"}
        if isinstance(st.item_id, str):
            item["id"] = st.item_id
        item["content"] = [part]
        return item

    def ended(self) -> bool:
        return self.state.finished

    def finish(self) -> bytes:
        """The events the client has not seen of a generation that is over (every token
        sent, or the upstream broke after its item was done): `.done` events, then
        `response.completed` (or `.incomplete` when the token budget ran out at the seam)."""
        st = self.state
        complete = st.finished
        parts: list[bytes] = []
        ids = {"item_id": st.item_id, "output_index": st.output_index}
        text = st.sent_text(0)
        if st.part_added and not st.text_done:
            done = {**ids, "content_index": st.content_index, "text": text, "logprobs": []}
            parts.append(self._event("response.output_text.done", done))
        if st.part_added and not st.part_done:
            part = {"type": "output_text", "text": text, "annotations": []}
            done = {**ids, "content_index": st.content_index, "part": part}
            parts.append(self._event("response.content_part.done", done))
        status = "completed" if complete else "incomplete"
        item = self._item(None, status) if st.item_added else None
        if item is not None and not complete:
            parts.append(
                self._event(
                    "response.output_item.done", {"output_index": st.output_index, "item": item}
                )
            )
        resp = copy.deepcopy(st.response) if st.response is not None else {"id": st.id}
        resp["status"] = status
        if item is not None:
            resp["output"] = [item]
        if not complete:
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        name = "response.completed" if complete else "response.incomplete"
        parts.append(self._event(name, {"response": resp}))
        st.done = True
        return b"".join(parts)

    def error(self, message: str) -> bytes:
        """`response.failed` once the client has a response object, else an `error` event."""
        st = self.state
        st.done = True
        if st.response is None:
            err = {"code": "upstream_stream_broken", "message": message, "param": None}
            return self._event("error", err)
        resp = copy.deepcopy(st.response)
        resp["status"] = "failed"
        resp["error"] = {"code": "server_error", "message": message}
        return self._event("response.failed", {"response": resp})

    def _event(self, name: str, fields: dict[str, Any]) -> bytes:
        st = self.state
        st.seq += 1
        return sse_event(name, {"type": name, **fields, "sequence_number": st.seq})


def _is_message(item: object) -> bool:
    return isinstance(item, dict) and item.get("type") == "message"


def _add_text(st: ResponsesState, obj: dict[str, Any]) -> None:
    piece = obj.get("delta")
    if isinstance(piece, str) and piece:
        st.text.setdefault(0, []).append(piece)
        st.tokens += 1


def _note(st: ResponsesState, t: object, obj: dict[str, Any]) -> None:
    """What an event other than a text delta or the terminal one says about the stream."""
    if t == "response.output_item.added" or t == "response.output_item.done":
        item = obj.get("item")
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            if t == "response.output_item.added":
                st.item_added, st.item_id = True, item.get("id")  # type: ignore[union-attr]
                st.output_index = int(obj.get("output_index") or 0)
            else:
                st.finished = True
        elif kind == "reasoning":
            st.reasoning = True
        elif isinstance(kind, str) and kind.endswith("_call"):
            st.tool_call = True  # function_call, and the built-in tools' calls
    elif t == "response.in_progress":
        st.in_progress = True
    elif t == "response.content_part.added":
        st.part_added = True
        st.content_index = int(obj.get("content_index") or 0)
    elif t == "response.output_text.done":
        st.text_done = True
    elif t == "response.content_part.done":
        st.part_done = True
    elif isinstance(t, str) and t.startswith(("response.function_call", "response.reasoning")):
        if "reasoning" in t:
            st.reasoning = True
        else:
            st.tool_call = True
