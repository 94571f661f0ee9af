"""OpenAI-compatible request parsing and response framing, as vLLM's server does them.

Pure: bytes in, a ``GenRequest`` or bytes out. Streaming chunks are assembled from a fixed
per-request head and tail around the JSON-encoded token, because a zero-delay benchmark
fleet streams hundreds of thousands of chunks and a dict-per-chunk dump costs ~3x more.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pulsegate.sim.text import count_words, ids_tail_keys, piece_id, text_ids

DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions; the sim uses it for chat too
DONE = b"data: [DONE]\n\n"

Kind = Literal["chat", "completion"]


class RequestError(Exception):
    """A request the engine refuses; carried to the client as an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def error_body(message: str, err_type: str, status: int) -> bytes:
    """``{"error": {...}}`` as vLLM sends it (``code`` is the HTTP status)."""
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    )


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: Kind
    model: str | None
    context: str  # generation continues this text (only its last two words matter)
    rendered: str  # the prompt as a chat template would render it: the prefix-cache key
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    seed: int | None
    # vLLM's `return_token_ids` (None: not asked): the prompt's ids, streamed on the first
    # chunk, and each token's.
    prompt_ids: tuple[int, ...] | None = None
    # A prompt of token ids: the generator's state (`text.ids_tail_keys`), not `context`.
    keys: tuple[int, int] | None = None


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


def _content_text(content: object) -> str:
    """A message's text: a string, null, or a list of content parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
        return " ".join(parts)
    raise _bad("message 'content' must be a string, null or a list of content parts")


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{key}' must be an integer, got {v!r}")
    return v


def _opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {v!r}")
    return v


def _common(body: dict[str, Any]) -> tuple[str | None, int, bool, bool, int | None]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string")
    max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.")
    stream = _opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object")
        include_usage = bool(opts.get("include_usage"))
    return model, max_tokens, stream, include_usage, _opt_int(body, "seed")


def _load(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _bad(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def chat_prompt(turns: list[tuple[str, str]], cont: bool, add_gen: bool) -> tuple[str, str]:
    """(the context the answer's words come from, the rendered prompt) of a conversation of
    (role, text) turns. A continued assistant turn (`cont`) goes on from the question's
    words followed by the words already given, so a continuation of a partial answer gives
    the rest of the uninterrupted one, whatever API asked for it."""
    texts = [t for _, t in turns]
    if cont:
        prev = texts[-2] if len(texts) >= 2 else ""
        context = prev + " " + texts[-1]
    else:
        context = texts[-1]
    rendered = "".join(f"<|{r}|>\n{t}\n" for r, t in turns)
    if add_gen:
        rendered += "<|assistant|>\n"
    return context, rendered


def chat_prompt_ids(texts: list[str], cont: bool) -> tuple[int, ...]:
    """The token ids of a conversation's prompt, as `return_token_ids` streams them: the
    words of every turn, with two padding ids (0) before the turns generation continues
    (`chat_prompt`'s context), so the last two ids of prompt + generated ids are always the
    generator's state: a completions request of those ids continues the answer exactly."""
    split = max(0, len(texts) - (2 if cont else 1))
    before = [i for t in texts[:split] for i in text_ids(t)]
    return (*before, 0, 0, *(i for t in texts[split:] for i in text_ids(t)))


def parse_chat(raw: bytes) -> GenRequest:
    """Parse a /v1/chat/completions body; honours vLLM's ``continue_final_message``."""
    body = _load(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required and must be a non-empty list")
    roles: list[str] = []
    texts: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message must be an object with a string 'role'")
        roles.append(m["role"])
        texts.append(_content_text(m.get("content")))
    model, max_tokens, stream, include_usage, seed = _common(body)
    cont = _opt_bool(body, "continue_final_message", False)
    add_gen = _opt_bool(body, "add_generation_prompt", not cont)
    if cont and add_gen:
        raise _bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if cont and roles[-1] != "assistant":
        raise _bad("`continue_final_message` needs the last message to be 'assistant'")
    context, rendered = chat_prompt(list(zip(roles, texts, strict=True)), cont, add_gen)
    ids = _opt_bool(body, "return_token_ids", False)
    return GenRequest(
        kind="chat",
        model=model,
        context=context,
        rendered=rendered,
        prompt_tokens=sum(count_words(t) for t in texts),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        seed=seed,
        prompt_ids=chat_prompt_ids(texts, cont) if ids else None,
    )


def parse_completion(raw: bytes) -> GenRequest:
    """Parse a /v1/completions body. A list of token ids is the prompt's tokens (vLLM's
    spelling; the padding id 0 is not counted); any other list is read as one prompt,
    items space-joined (vLLM would batch them; the sim serves one choice)."""
    body = _load(raw)
    prompt = body.get("prompt")
    ids = _opt_bool(body, "return_token_ids", False)
    if isinstance(prompt, list) and prompt and _all_ids(prompt):
        model, max_tokens, stream, include_usage, seed = _common(body)
        return GenRequest(
            kind="completion",
            model=model,
            context="",
            rendered=" ".join(map(str, prompt[:64])),
            prompt_tokens=sum(1 for t in prompt if t),
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
            seed=seed,
            prompt_ids=tuple(prompt) if ids else None,
            keys=ids_tail_keys(prompt),
        )
    if isinstance(prompt, list) and prompt:
        if not all(isinstance(p, str | int) and not isinstance(p, bool) for p in prompt):
            raise _bad("'prompt' list must hold strings or token ids")
        prompt = " ".join(str(p) for p in prompt)
    if not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' is required and must be a non-empty string or list")
    model, max_tokens, stream, include_usage, seed = _common(body)
    return GenRequest(
        kind="completion",
        model=model,
        context=prompt,
        rendered=prompt,
        prompt_tokens=count_words(prompt),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        seed=seed,
        prompt_ids=tuple(text_ids(prompt)) if ids else None,
    )


def _all_ids(prompt: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Framer:
    """Builds one response's bytes: SSE chunks or the whole JSON object."""

    __slots__ = (
        "_created",
        "_head",
        "_id",
        "_kind",
        "_model",
        "_prompt_ids",
        "_tok_head",
        "_tok_tail",
    )

    def __init__(
        self, kind: Kind, model: str, created: int, prompt_ids: tuple[int, ...] | None = None
    ) -> None:
        """`prompt_ids`: the request asked for `return_token_ids` (None: it did not); the
        chunks then carry them as vLLM 0.32 does (read in its `serving.py`)."""
        self._prompt_ids = prompt_ids
        self._kind = kind
        self._model = model
        self._created = created
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self._id = prefix + secrets.token_hex(16)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = orjson.dumps({"id": self._id, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1]  # without the closing brace, to append fields
        key = b'"delta":{"content":' if kind == "chat" else b'"text":'
        self._tok_head = self._head + b',"choices":[{"index":0,' + key
        self._tok_tail = b"}" if kind == "chat" else b""

    def first(self) -> bytes:
        """The role chunk a chat stream opens with; nothing for completions."""
        if self._kind != "chat":
            return b""
        role = (
            b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]'
        )
        if self._prompt_ids is not None:  # vLLM: the prompt's ids once, on this chunk
            role += b',"prompt_token_ids":' + orjson.dumps(self._prompt_ids)
        return self._head + role + b"}\n\n"

    def token(self, text: str, finish_reason: str | None = None) -> bytes:
        """One token's chunk; the last one carries ``finish_reason`` as vLLM's does."""
        if finish_reason is None:
            end = b',"logprobs":null,"finish_reason":null'
            if self._kind == "completion":
                end += b',"stop_reason":null'
        else:
            end = b',"logprobs":null,"finish_reason":"' + finish_reason.encode() + b'"'
            end += b',"stop_reason":null'
        if self._prompt_ids is not None:
            end += self._ids(text)
        return self._tok_head + orjson.dumps(text) + self._tok_tail + end + b"}]}\n\n"

    def _ids(self, text: str) -> bytes:
        """A token chunk's ids as vLLM puts them last on the choice (completions: the
        prompt's on the first token's chunk, null after)."""
        tid = b'"token_ids":[%d]' % piece_id(text)
        if self._kind == "chat":
            return b"," + tid
        prompt, self._prompt_ids = self._prompt_ids, ()
        head = b"null" if not prompt else orjson.dumps(prompt)
        return b',"prompt_token_ids":' + head + b"," + tid

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The separate usage chunk (``choices: []``) sent when include_usage is asked."""
        tail = orjson.dumps({"usage": _usage(prompt_tokens, completion_tokens)})
        return self._head + b',"choices":[],' + tail[1:] + b"\n\n"

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, n: int) -> bytes:
        """The non-streaming response object."""
        choice: dict[str, Any] = {"index": 0}
        if self._kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
        obj = "chat.completion" if self._kind == "chat" else "text_completion"
        return orjson.dumps(
            {
                "id": self._id,
                "object": obj,
                "created": self._created,
                "model": self._model,
                "choices": [choice],
                "usage": _usage(prompt_tokens, n),
            }
        )
