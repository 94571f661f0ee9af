"""Exact resume (#21 item 7): continue a broken vLLM stream as the token ids it generated.

Text replay (`chat.py`) sends the text already sent back as a prefill, and the engine
tokenizes it again. A text has many tokenizations and a model's own output is full of
non-canonical ones ("t" + "he" where the tokenizer says "the"), so the continuation may see
other tokens than were generated and take another path at the seam (docs/real-engines.md:
with a 256-token BPE, 800 generated tokens re-encoded to 812 different ids). vLLM says which
ids it generated when asked (`return_token_ids`, read in vLLM 0.32's `serving.py`):
`prompt_token_ids` on the first chunk (top level for chat, on the choice for completions) and
`token_ids` on each choice; its `/v1/completions` takes `prompt` as a list of ids. The prompt
ids plus the generated ids are the very sequence the engine held (for chat: the rendered
template), so a completions request of them goes on token for token, and its chunks are
mapped back into the client's framing (chat chunks from completions chunks).

When: the gateway asks for ids (`wanted`) only for a stream to a `token_ids` target (vLLM
with `exact_resume`), chat or completions, that the completions continuation can carry
whole (`fits`: plain sampling keys, a token budget, no stop strings, no logprobs or tools),
and whose client did not set `return_token_ids` itself. Ids the client did not ask for are
replaced by `null` where vLLM put them (`Ids.take`): the client gets the bytes vLLM sends
without the flag (`"token_ids":null`), no id. A break continues as ids only on a target
with the same flag (the same engine kind; the router picks the same model), when every
content chunk carried its ids; ids at the tail whose text had not come yet (held by the
detokenizer) are left for the continuation to generate again. Anything else: text replay.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from pulsegate.proxy.dialects.base import Continuation, StreamState
from pulsegate.proxy.dialects.chat import resume_refusal
from pulsegate.proxy.request import ProxyRequest
from pulsegate.proxy.targets import Target

COMPLETIONS = "/v1/completions"
_FLAG = b',"return_token_ids":true}'
# Where vLLM puts ids on a chunk: `"token_ids":[` and `"prompt_token_ids":[`. A match is a
# key, never text: inside a JSON string every quote is escaped (`\"`).
_KEY = b'token_ids":['
_NULLED = b'token_ids":null'
_PLAIN = frozenset({"role", "content"})  # a delta of plain text, which ids stand for

# Chat keys the completions continuation carries as they are (sampling, vLLM's extras).
_CARRY = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "user",
        "priority",
        "stream_options",
    }
)
# Chat keys that shape only the prompt (its ids already hold it) or the framing.
_PROMPT_ONLY = frozenset(
    {
        "model",
        "messages",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "return_token_ids",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "request_id",
        "session_id",
        "n",
        "stop",
    }
)
# Completions keys the continuation cannot honour from ids (text offsets, echo, a suffix).
_COMPLETION_UNFIT = ("echo", "logprobs", "suffix", "prompt_logprobs", "prompt_embeds")


def fits(doc: dict[str, Any], api: str) -> bool:
    """Whether a continuation as ids can carry this request whole: resumable at all, no
    stop strings (the engine holds text back while a stop may be matching, so the ids run
    ahead of the text), and, for chat, a token budget (vLLM's chat default, the model's
    context left, cannot be written in a completions request) and nothing but `_CARRY` and
    `_PROMPT_ONLY` keys."""
    if resume_refusal(doc, StreamState()) is not None or doc.get("stop"):
        return False
    if api == "completions":
        return not any(doc.get(k) for k in _COMPLETION_UNFIT)
    if api != "chat" or _budget(doc) is None:
        return False
    return all(k in _CARRY or k in _PROMPT_ONLY for k in doc)


def wanted(req: ProxyRequest, target: Target, resume: bool) -> bool:
    """Whether this stream tracks token ids on `target` (`resume`: streams may resume)."""
    return (
        resume
        and req.stream
        and target.token_ids
        and req.api in ("chat", "completions")
        and req.doc.get("return_token_ids") in (None, True)
        and fits(req.doc, req.api)
    )


def first_body(req: ProxyRequest, target: Target, resume: bool) -> bytes:
    """The body a first attempt sends `target`: the client's bytes, plus
    `"return_token_ids":true` before the closing brace when the gateway wants the ids and
    the client did not ask (a body is a JSON object: the parse checked)."""
    if "return_token_ids" in req.doc or not wanted(req, target, resume):
        return req.body
    body = req.body.rstrip()
    return body[:-1] + _FLAG


@dataclass(slots=True)
class Ids:
    """The token ids of one stream: the prompt's, the generated ones, and whether they can
    stand for what the client was sent. `strip`: the client did not ask for them."""

    strip: bool
    prompt: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    held: int = 0  # ids at the tail whose text has not come (held by the detokenizer)
    whole: bool = True  # every content chunk carried its ids, nothing else in the delta

    @classmethod
    def of(cls, req: ProxyRequest, target: Target, resume: bool) -> Ids | None:
        """The ids of a stream of `req` on `target`, when it has them (`wanted`)."""
        if not wanted(req, target, resume):
            return None
        return cls(strip="return_token_ids" not in req.doc)

    def take(self, obj: dict[str, Any], raw: bytes) -> bytes:
        """Note a pass-through chunk's ids; the bytes the client gets (ids made `null`
        when it did not ask for them). Worked example: `..."token_ids":[35]}]}` becomes
        `..."token_ids":null}]}`, vLLM's own bytes without the flag."""
        found = self.note(obj)
        if not self.strip or not found:
            return raw
        out, n = _null_lists(raw)
        if n == found:
            return out
        _null_ids(obj)  # an unusual layout (spaces, another order): re-made from the object
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def note(self, obj: dict[str, Any], first: bool = True) -> int:
        """Note one chunk's ids (chat or completions framing); how many id lists it held.
        `first`: a chunk of the first upstream, whose prompt ids are the prompt's (a
        continuation's are the prompt's and the ids it was sent: already known)."""
        found = 0
        top = obj.get("prompt_token_ids")
        if isinstance(top, list):
            found = 1
            if first:
                self.prompt = top
        for ch in obj.get("choices") or ():
            p = ch.get("prompt_token_ids")
            if isinstance(p, list):
                found += 1
                if first:
                    self.prompt = p
            ids = ch.get("token_ids")
            delta = ch.get("delta")
            piece = delta.get("content") if delta is not None else ch.get("text")
            if delta is not None and not delta.keys() <= _PLAIN:
                self.whole = False  # reasoning, tool calls: not plain text from the ids
            if isinstance(ids, list):
                found += 1
                self.generated.extend(ids)
                self.held = 0 if piece else self.held + len(ids)
            elif piece:
                self.whole = False  # text without its ids
        return found

    @property
    def barren(self) -> bool:
        """Text came without ids and no id ever came: the engine does not send them (an
        older vLLM, another engine behind `token_ids: true`), so there is nothing to note
        or strip in the rest of the stream, and the ids can never stand for it."""
        return not self.whole and not self.generated and self.prompt is None

    def usable(self, target: Target) -> bool:
        """Whether the break may continue as ids on `target`."""
        return target.token_ids and self.whole and self.prompt is not None

    def sent(self) -> int:
        """The tokens whose text the client has."""
        return len(self.generated) - self.held

    def continuation(self, doc: dict[str, Any], api: str, state: StreamState) -> Continuation:
        """The completions request going on from the ids of what the client has: prompt ids
        + generated ids, the budget less `state.tokens` (set to `sent()` by the caller),
        ids asked again (for a later break), usage when the client asked for it."""
        ids = [*(self.prompt or ()), *self.generated[: self.sent()]]
        del self.generated[self.sent() :]
        self.held = 0
        if api == "chat":
            new = {k: v for k, v in doc.items() if k in _CARRY}
            new["model"] = doc["model"]
        else:
            new = dict(doc)
            new.pop("max_completion_tokens", None)
        budget = _budget(doc)
        new["max_tokens"] = max(1, (16 if budget is None else budget) - state.tokens)
        mt = doc.get("min_tokens")
        if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0:
            new["min_tokens"] = max(0, mt - state.tokens)
        new["prompt"] = ids
        new["stream"] = True
        new["return_token_ids"] = True
        return Continuation(orjson.dumps(new), COMPLETIONS)

    def to_client(self, obj: dict[str, Any], api: str) -> dict[str, Any]:
        """A continuation chunk (completions framing) noted and made the client's: chat
        chunks for a chat stream; ids `null` when the client did not ask for them. The chat
        dialect's `rewrite` then stamps it (id, created, model) and merges usage."""
        self.note(obj, first=False)
        if api == "chat":
            obj = _as_chat(obj)
        if self.strip:
            _null_ids(obj)
        return obj


def _null_lists(raw: bytes) -> tuple[bytes, int]:
    """`raw` with each id list (`_KEY` to the next `]`: ids hold no `]`) made `null`, and how
    many there were. Plain finds and slices (a chunk has one list, the first two): ~1 us on a
    200-byte chunk, a regex with a group took ~3x that."""
    n = 0
    i = raw.find(_KEY)
    while i >= 0:
        j = raw.find(b"]", i)
        if j < 0:
            break
        raw, n = raw[:i] + _NULLED + raw[j + 1 :], n + 1
        i = raw.find(_KEY, i + len(_NULLED))
    return raw, n


def _budget(doc: dict[str, Any]) -> int | None:
    v = doc.get("max_completion_tokens", doc.get("max_tokens"))
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _null_ids(obj: dict[str, Any]) -> None:
    if "prompt_token_ids" in obj:
        obj["prompt_token_ids"] = None
    for ch in obj.get("choices") or ():
        for k in ("prompt_token_ids", "token_ids"):
            if k in ch:
                ch[k] = None


def _as_chat(obj: dict[str, Any]) -> dict[str, Any]:
    """A completions chunk as vLLM's chat would have framed it (its field order)."""
    out: dict[str, Any] = {
        "id": obj.get("id"),
        "object": "chat.completion.chunk",
        "created": obj.get("created"),
        "model": obj.get("model"),
    }
    choices = []
    for ch in obj.get("choices") or ():
        c: dict[str, Any] = {
            "index": ch.get("index", 0),
            "delta": {"content": ch.get("text") or ""},
            "logprobs": None,
            "finish_reason": ch.get("finish_reason"),
        }
        if ch.get("finish_reason") is not None:
            c["stop_reason"] = ch.get("stop_reason")
        c["token_ids"] = ch.get("token_ids")
        choices.append(c)
    out["choices"] = choices
    if obj.get("usage") is not None:
        out["usage"] = obj["usage"]
    return out


__all__ = ["COMPLETIONS", "Ids", "first_body", "fits", "wanted"]
