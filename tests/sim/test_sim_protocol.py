"""Request parsing and SSE framing, byte for byte (no sockets)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pulsegate.sim.protocol import (
    DEFAULT_MAX_TOKENS,
    Framer,
    RequestError,
    parse_chat,
    parse_completion,
)


def _chat(**body: object) -> bytes:
    return orjson.dumps({"model": "m", **body})


def test_chat_defaults_and_counts() -> None:
    """Context is the last message; prompt_tokens counts words of every message."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    req = parse_chat(_chat(messages=msgs))
    assert (req.context, req.prompt_tokens, req.max_tokens) == ("hi there", 4, DEFAULT_MAX_TOKENS)
    assert not req.stream and not req.include_usage and req.seed is None
    assert req.rendered.endswith("<|assistant|>\n")


def test_max_completion_tokens_and_content_parts() -> None:
    """max_completion_tokens is accepted; list content parts are joined text."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "image"}]}]
    req = parse_chat(_chat(messages=msgs, max_completion_tokens=3))
    assert (req.max_tokens, req.context) == (3, "a b")


def test_continue_final_message_context() -> None:
    """continue_final_message continues the assistant's partial text after the question."""
    msgs = [{"role": "user", "content": "q1 q2"}, {"role": "assistant", "content": " x y"}]
    req = parse_chat(_chat(messages=msgs, continue_final_message=True, add_generation_prompt=False))
    assert req.context.split() == ["q1", "q2", "x", "y"]
    assert not req.rendered.endswith("<|assistant|>\n")
    plain = parse_chat(_chat(messages=msgs))
    assert plain.context == " x y"  # without the flag: just the last message


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{nope", "Invalid JSON"),
        (b"[]", "JSON object"),
        (_chat(), "'messages' is required"),
        (_chat(messages=[{"content": "x"}]), "string 'role'"),
        (_chat(messages=[{"role": "user", "content": "x"}], max_tokens=0), "at least 1"),
        (_chat(messages=[{"role": "user", "content": "x"}], stream="yes"), "boolean"),
        (
            _chat(
                messages=[{"role": "assistant", "content": "x"}],
                continue_final_message=True,
                add_generation_prompt=True,
            ),
            "Cannot set both",
        ),
        (
            _chat(messages=[{"role": "user", "content": "x"}], continue_final_message=True),
            "last message to be 'assistant'",
        ),
    ],
)
def test_chat_rejects(raw: bytes, needle: str) -> None:
    """Malformed chat bodies are 400s naming the problem."""
    with pytest.raises(RequestError) as e:
        parse_chat(raw)
    assert e.value.status == 400 and needle in e.value.message


def test_completion_prompt_forms() -> None:
    """A string prompt or a list (space-joined); empty or missing is a 400."""
    assert parse_completion(b'{"prompt": "a b c"}').prompt_tokens == 3
    assert parse_completion(b'{"prompt": ["a b", "c"]}').context == "a b c"
    for raw in (b"{}", b'{"prompt": ""}', b'{"prompt": [true]}'):
        with pytest.raises(RequestError):
            parse_completion(raw)


def _sse(data: bytes) -> dict[str, Any]:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    out: dict[str, Any] = orjson.loads(data[6:-2])
    return out


def test_chat_framing_matches_vllm() -> None:
    """Role chunk, token chunks, finish_reason on the last token, separate usage chunk."""
    f = Framer("chat", "m", 123)
    first, tok, last, usage = (
        _sse(f.first()),
        _sse(f.token(" a")),
        _sse(f.token(" b", "length")),
        (_sse(f.usage(3, 2))),
    )
    assert str(first["id"]).startswith("chatcmpl-") and first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    assert tok["choices"][0]["delta"] == {"content": " a"}
    assert last["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 5,
        "completion_tokens": 2,
    }
    assert {first["id"], tok["id"], last["id"], usage["id"]} == {first["id"]}


def test_completion_framing_and_whole() -> None:
    """Completion chunks carry `text`; the whole response has usage and the joined text."""
    f = Framer("completion", "m", 1)
    assert f.first() == b""
    chunk = _sse(f.token(' "q"\n'))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == ' "q"\n'
    whole = orjson.loads(f.whole(" a b", "length", 4, 2))
    assert str(whole["id"]).startswith("cmpl-") and whole["choices"][0]["text"] == " a b"
    assert whole["usage"]["total_tokens"] == 6
