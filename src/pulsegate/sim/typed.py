"""The typed APIs of the sim: OpenAI Responses (`/v1/responses`) and Anthropic Messages
(`/v1/messages`), streamed and not, framed as vLLM frames them. Pure apart from the sink.

Generation is the chat flow's (same faults, TTFT, ITL, batch slots, deterministic text), so
a continuation splices exactly: a Responses request whose `input` ends with an assistant
message of status `in_progress` or `incomplete` continues that text (vLLM 0.32's partial
message completion); a Messages request whose last message is the assistant's continues it
(Anthropic's prefill; vLLM 0.32's `/v1/messages` does not, it starts a new turn, which is
why the gateway continues Messages streams on vLLM through `/v1/chat/completions` with
`continue_final_message`). Both give the same context (the question's words, then the
words already given), so the same text follows the seam either way
(tests/proxy/test_dialect_messages.py checks it).

Streams are `event: TYPE` + one `data:` line, no `[DONE]` (vLLM's `/v1/responses` and
`/v1/messages`). Responses: `response.created`, `.in_progress`, `.output_item.added`,
`.content_part.added`, one `.output_text.delta` per token, the `.done` events and
`response.completed` with usage; `sequence_number` counts from 0. Messages: `message_start`,
`content_block_start`, one `content_block_delta` per token, `content_block_stop`,
`message_delta` (stop_reason, usage), `message_stop`.

Stored responses (`store` not false, OpenAI's default) are remembered by id, at most
`STORED` of them: a `previous_response_id` this sim never produced is a 404, as vLLM answers
it, so a request routed to the wrong backend shows.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from pulsegate.sim.protocol import (
    Framer,
    GenRequest,
    RequestError,
    _bad,
    _content_text,
    _load,
    _opt_bool,
    _opt_int,
    chat_prompt,
)
from pulsegate.sim.sink import TokenSink
from pulsegate.sim.text import count_words

DEFAULT_MAX_TOKENS = 16
STORED = 4096  # response ids remembered for previous_response_id (~100 B each)


@dataclass(frozen=True, slots=True)
class TypedRequest(GenRequest):
    api: str = "responses"  # or "messages"
    store: bool = False
    previous_response_id: str | None = None
    instructions: str | None = None


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def _part_text(content: object) -> str:
    """Text of a Responses content list (input_text / output_text / text parts) or string."""
    if isinstance(content, list):
        return " ".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return _content_text(content)


def _partial(given: object) -> bool:
    """vLLM's partial-message completion: the last input item is an assistant message
    whose status is `in_progress` or `incomplete`."""
    if not isinstance(given, list) or not given or not isinstance(given[-1], dict):
        return False
    last = given[-1]
    return (
        last.get("type", "message") == "message"
        and last.get("role") == "assistant"
        and last.get("status") in ("in_progress", "incomplete")
    )


def _request(
    api: str, body: dict[str, Any], turns: list[tuple[str, str]], max_tokens: int | None, **kw: Any
) -> TypedRequest:
    if not turns:
        raise _bad("the conversation has no messages")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise _bad(f"max tokens must be at least 1, got {max_tokens}.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string")
    texts = [t for _, t in turns]
    cont = kw.pop("cont")
    context, rendered = chat_prompt(turns, cont, not cont)
    return TypedRequest(
        kind="chat",
        model=model,
        context=context,
        rendered=rendered,
        prompt_tokens=sum(count_words(t) for t in texts),
        max_tokens=max_tokens,
        stream=_opt_bool(body, "stream", False),
        include_usage=False,
        seed=_opt_int(body, "seed"),
        api=api,
        **kw,
    )


class TypedApis:
    """The Responses and Messages endpoints of one sim: parsing, the response store, sinks."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._stored: OrderedDict[str, None] = OrderedDict()

    def remember(self, response_id: str) -> None:
        self._stored[response_id] = None
        if len(self._stored) > STORED:
            self._stored.popitem(last=False)

    def parse_responses(self, raw: bytes) -> GenRequest:
        body = _load(raw)
        given = body.get("input")
        turns: list[tuple[str, str]] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            turns.append(("system", instructions))
        if isinstance(given, str) and given:
            turns.append(("user", given))
        elif isinstance(given, list) and given:
            for item in given:
                if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                    continue  # function_call_output and the like: no text turn here
                turns.append((item["role"], _part_text(item.get("content"))))
        else:
            raise _bad("'input' is required: a string or a non-empty list of items")
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str) or prev not in self._stored:
                raise RequestError(404, f"Response with id '{prev}' not found.", "NotFoundError")
            self._stored.move_to_end(prev)
        return _request(
            "responses",
            body,
            turns,
            _opt_int(body, "max_output_tokens"),
            cont=_partial(given),
            store=_opt_bool(body, "store", True),
            previous_response_id=prev,
            instructions=instructions if isinstance(instructions, str) else None,
        )

    def parse_messages(self, raw: bytes) -> GenRequest:
        body = _load(raw)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' is required and must be a non-empty list")
        turns: list[tuple[str, str]] = []
        system = body.get("system")
        if system:
            turns.append(("system", _part_text(system)))
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise _bad("each message must be an object with role 'user' or 'assistant'")
            turns.append((m["role"], _part_text(m.get("content"))))
        max_tokens = _opt_int(body, "max_tokens")
        if max_tokens is None:
            raise _bad("'max_tokens' is required")
        # A final assistant message is a prefill in Anthropic's API: the model continues it.
        return _request("messages", body, turns, max_tokens, cont=turns[-1][0] == "assistant")

    def sink(self, req: GenRequest, created: int) -> TokenSink:
        assert isinstance(req, TypedRequest)
        framer: TypedFramer
        if req.api == "messages":
            framer = MessagesFramer(self.model, created, req)
        else:
            framer = ResponsesFramer(self.model, created, req, self)
        return TypedSink(framer)


class TypedFramer(Framer):
    """A typed API's events; `end` replaces the chat stream's usage chunk and `[DONE]`."""

    __slots__ = ("req", "texts")

    def __init__(self, model: str, created: int, req: TypedRequest) -> None:
        super().__init__("chat", model, created)
        self.req = req
        self.texts: list[str] = []

    def end(self, prompt_tokens: int, n: int) -> bytes:
        raise NotImplementedError


class ResponsesFramer(TypedFramer):
    __slots__ = ("apis", "item_id", "resp_id", "seq")

    def __init__(self, model: str, created: int, req: TypedRequest, apis: TypedApis) -> None:
        super().__init__(model, created, req)
        self.apis = apis
        self.resp_id = "resp_" + secrets.token_hex(16)
        self.item_id = "msg_" + secrets.token_hex(16)
        self.seq = -1

    def _ev(self, name: str, **fields: Any) -> bytes:
        self.seq += 1
        return _event(name, {"type": name, **fields, "sequence_number": self.seq})

    def _response(self, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.resp_id,
            "object": "response",
            "created_at": self._created,
            "model": self._model,
            "status": status,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_tokens,
            "metadata": {},
            "parallel_tool_calls": True,
            "previous_response_id": r.previous_response_id,
            "reasoning": None,
            "store": r.store,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "background": False,
        }

    def _item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "in_progress":
            content = []
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def first(self) -> bytes:
        ids = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return b"".join(
            (
                self._ev("response.created", response=self._response("in_progress", [], None)),
                self._ev("response.in_progress", response=self._response("in_progress", [], None)),
                self._ev(
                    "response.output_item.added",
                    output_index=0,
                    item=self._item("", "in_progress"),
                ),
                self._ev("response.content_part.added", **ids, part=part),
            )
        )

    def token(self, text: str, finish_reason: str | None = None) -> bytes:
        self.texts.append(text)
        return self._ev(
            "response.output_text.delta",
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _usage(self, prompt_tokens: int, n: int) -> dict[str, Any]:
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + n,
        }

    def end(self, prompt_tokens: int, n: int) -> bytes:
        text = "".join(self.texts)
        ids = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = self._item(text, "completed")
        if self.req.store:
            self.apis.remember(self.resp_id)
        done = self._response("completed", [item], self._usage(prompt_tokens, n))
        return b"".join(
            (
                self._ev("response.output_text.done", **ids, text=text, logprobs=[]),
                self._ev("response.content_part.done", **ids, part=part),
                self._ev("response.output_item.done", output_index=0, item=item),
                self._ev("response.completed", response=done),
            )
        )

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, n: int) -> bytes:
        if self.req.store:
            self.apis.remember(self.resp_id)
        item = self._item(text, "completed")
        return orjson.dumps(self._response("completed", [item], self._usage(prompt_tokens, n)))


class MessagesFramer(TypedFramer):
    __slots__ = ("msg_id",)

    def __init__(self, model: str, created: int, req: TypedRequest) -> None:
        super().__init__(model, created, req)
        self.msg_id = "msg_" + secrets.token_hex(12)

    def first(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.req.prompt_tokens, "output_tokens": 0},
        }
        block = {"type": "text", "text": ""}
        return _event("message_start", {"type": "message_start", "message": message}) + _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )

    def token(self, text: str, finish_reason: str | None = None) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def end(self, prompt_tokens: int, n: int) -> bytes:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"input_tokens": prompt_tokens, "output_tokens": n},
        }
        return b"".join(
            (
                _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event("message_delta", delta),
                _event("message_stop", {"type": "message_stop"}),
            )
        )

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, n: int) -> bytes:
        return orjson.dumps(
            {
                "id": self.msg_id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "model": self._model,
                "stop_reason": "max_tokens",
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": n},
            }
        )


class TypedSink(TokenSink):
    """A typed stream ends with its framer's closing events, never `[DONE]`."""

    __slots__ = ("_typed",)

    def __init__(self, framer: TypedFramer) -> None:
        super().__init__(framer)
        self._typed = framer

    async def finish(self, req: GenRequest, n: int) -> web.StreamResponse:
        if self._resp is None:
            return await super().finish(req, n)
        self._buf.append(self._typed.end(req.prompt_tokens, n))
        await self.flush()
        await self._resp.write_eof()
        return self._resp
