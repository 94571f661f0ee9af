"""What each API's body must hold before any backend sees it, and how it is timed. Pure.

One `Spec` per API label (`request.API`): the fields the engine cannot do without (vLLM's
required fields: a request without them would only come back as a 400 or 422 from the
engine after a pick, an upstream round trip and an outcome), whether it may stream, and
which field bounds its output for the first-byte deadline. Only presence and type are
checked here: the engine validates the rest, and its 4xx is passed on in the API's shape.
The chat and completions checks are `validate.py`'s (OpenAI's ranges, message shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pulsegate.proxy.validate import invalid_field

# (message, code): why the body is refused, 400.
Why = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Spec:
    """One API's needs: `check` the body, `streams` (may it ask `stream: true`), and
    `tokens`: the fields bounding its output tokens, first found wins; None for the APIs
    that generate nothing (embeddings, rerank, score, tokenize), whose answer comes as soon
    as the prompt is read, like a stream's first token."""

    check: Callable[[dict[str, Any]], Why | None]
    streams: bool
    tokens: tuple[str, ...] | None


def _chat(doc: dict[str, Any]) -> Why | None:
    msgs = doc.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "'messages' is required and must be a non-empty list", "missing_messages"
    why = invalid_field(doc, True)
    return None if why is None else (why, "invalid_request")


def _completions(doc: dict[str, Any]) -> Why | None:
    if "prompt" not in doc:
        return "'prompt' is required", "missing_prompt"
    why = invalid_field(doc, False)
    return None if why is None else (why, "invalid_request")


def _stream_flag(doc: dict[str, Any]) -> Why | None:
    v = doc.get("stream")
    if v is not None and not isinstance(v, bool):
        return f"'stream' must be true or false, got {v!r}", "invalid_request"
    return None


def _count(doc: dict[str, Any], key: str, required: bool) -> Why | None:
    v = doc.get(key)
    if v is None:
        return (f"'{key}' is required", f"missing_{key}") if required else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        return f"'{key}' must be an integer >= 1, got {v!r}", "invalid_request"
    return None


def _responses(doc: dict[str, Any]) -> Why | None:
    inp = doc.get("input")
    if not isinstance(inp, str | list) or not inp:
        return "'input' is required: a string or a non-empty list of items", "missing_input"
    return _stream_flag(doc) or _count(doc, "max_output_tokens", False)


def _messages(doc: dict[str, Any]) -> Why | None:
    """Anthropic Messages: `messages` and `max_tokens` are both required there."""
    msgs = doc.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "'messages' is required and must be a non-empty list", "missing_messages"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"'messages[{i}]' must be an object with a string 'role'", "invalid_request"
    return _count(doc, "max_tokens", True) or _stream_flag(doc)


def _embeddings(doc: dict[str, Any]) -> Why | None:
    inp = doc.get("input")
    if isinstance(inp, str) or (isinstance(inp, list) and inp):
        return None
    return "'input' is required: a string or a non-empty list", "missing_input"


def _texts(v: object) -> bool:
    return isinstance(v, str) or (
        isinstance(v, list) and bool(v) and all(isinstance(s, str | dict) for s in v)
    )


def _rerank(doc: dict[str, Any]) -> Why | None:
    if not isinstance(doc.get("query"), str):
        return "'query' is required and must be a string", "missing_query"
    docs = doc.get("documents")
    if not isinstance(docs, list) or not docs:
        return "'documents' is required and must be a non-empty list", "missing_documents"
    return _count(doc, "top_n", False)


def _score(doc: dict[str, Any]) -> Why | None:
    for key in ("text_1", "text_2"):
        if not _texts(doc.get(key)):
            return f"'{key}' is required: a string or a non-empty list", "missing_text"
    return None


def _tokenize(doc: dict[str, Any]) -> Why | None:
    if isinstance(doc.get("prompt"), str):
        return None
    msgs = doc.get("messages")
    if isinstance(msgs, list) and msgs:
        return None
    return "'prompt' (a string) or 'messages' (a non-empty list) is required", "missing_prompt"


def _detokenize(doc: dict[str, Any]) -> Why | None:
    tokens = doc.get("tokens")
    if isinstance(tokens, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        return None
    return "'tokens' is required and must be a list of integers", "missing_tokens"


_OPENAI_TOKENS = ("max_completion_tokens", "max_tokens")

SPECS: dict[str, Spec] = {
    "chat": Spec(_chat, True, _OPENAI_TOKENS),
    "completions": Spec(_completions, True, _OPENAI_TOKENS),
    "responses": Spec(_responses, True, ("max_output_tokens",)),
    "messages": Spec(_messages, True, ("max_tokens",)),
    "embeddings": Spec(_embeddings, False, None),
    "rerank": Spec(_rerank, False, None),
    "score": Spec(_score, False, None),
    "tokenize": Spec(_tokenize, False, None),
    "detokenize": Spec(_detokenize, False, None),
}


def anthropic_user(doc: dict[str, Any]) -> str | None:
    """Anthropic's per-user key, `metadata.user_id` (its `user` field)."""
    meta = doc.get("metadata")
    uid = meta.get("user_id") if isinstance(meta, dict) else None
    return uid if isinstance(uid, str) and uid else None
