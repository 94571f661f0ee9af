"""Streams that survive (R7, R21): relay SSE, and continue a broken generation elsewhere.

The first upstream's events are forwarded byte for byte, one whole event at a time, while
`StreamState` notes what the client has received (id, created, model, text per choice,
tokens). When the upstream breaks (reset, EOF without `[DONE]`, malformed event) or stalls
(no bytes for `streaming.stall_timeout`, or its backend is ejected meanwhile), the relay
asks another backend to continue: the prompt (completions) or an assistant message
(chat, `continue_final_message`) carries the text already sent, `max_tokens` shrinks by
the tokens already sent (counted by the continuation target's tokenizer when it has
`/tokenize`, else one per event), and the new events are rewritten to the first stream's id,
created and model, minus the role preamble. The client sees one stream, one `[DONE]`.
Between vLLM backends a chat or completions stream goes on from the token ids it generated
instead (`dialects/token_ids.py`: exact where a text has several tokenizations), text replay
being the fallback.

What is never resumed - `n > 1`, a tool call in flight, constrained decoding - ends with a
terminal error event in OpenAI's shape: never a silent truncation.

Each API's framing is a dialect (`proxy/dialects/`: chat and completions, the Responses API,
Anthropic Messages); this module keeps what all of them share with the attempt opener (the
`/tokenize` count) and the chat dialect's names, which tests and tools import from here.
"""

from __future__ import annotations

import orjson

from pulsegate.proxy.dialects.base import StreamState
from pulsegate.proxy.dialects.chat import (
    finish_chunk,
    remaining_tokens,
    resume_body,
    resume_refusal,
    rewrite,
    track,
)


def tokenize_request(model: str, text: str) -> bytes:
    """vLLM's `POST /tokenize` for the generated text alone (no BOS: it is not a prompt)."""
    return orjson.dumps({"model": model, "prompt": text, "add_special_tokens": False})


def token_count(body: bytes) -> int | None:
    """The token count of a `/tokenize` answer (`{"count": N, "tokens": [...]}`), or None."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    count = doc.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    tokens = doc.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


__all__ = [
    "StreamState",
    "finish_chunk",
    "remaining_tokens",
    "resume_body",
    "resume_refusal",
    "rewrite",
    "token_count",
    "tokenize_request",
    "track",
]
