"""A broken Anthropic Messages stream continued through vLLM's `/v1/chat/completions`.

Why not `/v1/messages` again: vLLM 0.32's Messages endpoint turns the request into a chat
request with `add_generation_prompt` on, so a final assistant message (Anthropic's prefill)
is rendered as a finished turn and the model starts a new one after it: measured on real
vLLM (tests/engines/test_real_typed_resume.py) the text after the seam was a fresh answer,
not the rest of the greedy one. Its chat endpoint has `continue_final_message`, which
continues the assistant message token for token, as chat streams resume (dialects/chat.py).

`chat_body` translates the conversation the way vLLM's own Messages converter does
(`vllm/entrypoints/anthropic`), so the prompt tokens are the same ones the first stream was
generated from: the `system` string, or its text blocks concatenated; a message's string
content as is, its text blocks as OpenAI text parts (empty ones dropped, one part as a plain
string); the text sent appended to the client's own prefill, or as a new assistant message.
Sampling carries over (`temperature`, `top_p`, `top_k`, `seed`, `stop_sequences` as `stop`).

What chat cannot carry faithfully returns None and the caller keeps the `/v1/messages`
prefill (the stream stays whole; its text may not be the uninterrupted one on vLLM): image,
document, tool_use, tool_result or thinking blocks in the history, `tools`, `tool_choice`,
an enabled `thinking`.
"""

from __future__ import annotations

from typing import Any

import orjson

CHAT_PATH = "/v1/chat/completions"
# vLLM's own map (`AnthropicServingMessages.stop_reason_map`); any other reason (`abort`)
# ends the turn.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_SAMPLING = ("temperature", "top_p", "top_k", "seed")


def chat_body(doc: dict[str, Any], text: str, max_tokens: int | None) -> bytes | None:
    """The chat request continuing `doc` (a Messages request) after `text`, asking for at
    most `max_tokens` more; None when the conversation does not translate faithfully."""
    if doc.get("tools") or doc.get("tool_choice") is not None or _thinking(doc):
        return None
    msgs: list[dict[str, Any]] = []
    system = doc.get("system")
    if system:
        joined = _joined(system)
        if joined is None:
            return None
        msgs.append({"role": "system", "content": joined})
    for m in doc["messages"]:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            return None
        content = _content(m.get("content"))
        if content is None:
            return None
        msgs.append({"role": m["role"], "content": content})
    last = msgs[-1] if msgs else None
    if last is not None and last["role"] == "assistant":
        given = _joined(doc["messages"][-1].get("content"))  # the client's own prefill
        last["content"] = (given or "") + text
    else:
        msgs.append({"role": "assistant", "content": text})
    new: dict[str, Any] = {
        "model": doc.get("model"),
        "messages": msgs,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_tokens is not None:
        new["max_tokens"] = max(1, max_tokens)
    for key in _SAMPLING:
        if doc.get(key) is not None:
            new[key] = doc[key]
    stops = doc.get("stop_sequences")
    if stops:
        new["stop"] = stops
    return orjson.dumps(new)


def _thinking(doc: dict[str, Any]) -> bool:
    t = doc.get("thinking")
    return isinstance(t, dict) and t.get("type") not in (None, "disabled")


def _texts(content: object) -> list[str] | None:
    """The non-empty texts of a list of content blocks; None if any block is not text."""
    if not isinstance(content, list):
        return None
    out: list[str] = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            return None
        t = block.get("text")
        if not isinstance(t, str):
            return None
        if t:
            out.append(t)
    return out


def _joined(content: object) -> str | None:
    """A string, or the texts of text blocks concatenated (vLLM's `system` and, here, the
    prefill the sent text continues); None for anything else."""
    if isinstance(content, str):
        return content
    texts = _texts(content)
    return None if texts is None else "".join(texts)


def _content(content: object) -> str | list[dict[str, str]] | None:
    if isinstance(content, str):
        return content
    texts = _texts(content)
    if texts is None:
        return None
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]
