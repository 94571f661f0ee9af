"""Properties of the resume body builders (`proxy/dialects/chat.py`, `responses.py`,
`messages.py` and its vLLM chat translation) for any request and any text already sent.

`test_resume_body.py` and `test_dialect_*.py` check worked examples and that a stream cut
anywhere reads as one; here the request document is drawn (any extra fields with any JSON
values, any budget, string or list content) and so is the text sent. What must hold (issue
#22): whenever the dialect agrees to resume (`refusal` is None), the continuation body is
valid JSON, keeps the model, carries the text sent, asks for `max(1, budget - tokens sent)`
tokens (never more than the client allowed, at least 1) and leaves the client's doc as it was.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.proxy.dialects import Chat, Messages, Responses
from pulsegate.proxy.request import CHAT, COMPLETIONS

# What `orjson.loads` can hand the proxy: no lone surrogates, ints within 64 bits, no NaN.
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_int = st.integers(-(2**63), 2**64 - 1)
_json = st.recursive(
    st.none() | st.booleans() | _int | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_budget = st.one_of(st.none(), st.integers(-5, 2**64 - 1), st.integers(0, 50), _json)
_extras = st.dictionaries(
    _text.filter(lambda k: k not in ("model", "messages", "prompt", "input")), _json, max_size=4
)
_pieces = st.lists(_text.filter(bool), max_size=8)


def _budget_ok(before: Any, after: Any, tokens: int) -> None:
    """The continuation asks for what is left, never more than the client allowed, >= 1."""
    if isinstance(before, int) and not isinstance(before, bool):
        assert after == max(1, before - tokens)
        assert after <= max(1, before)
    else:
        assert after in (before, None)  # not a budget: as it was, or (to chat) left out


def _sent(dialect: Chat | Messages | Responses, pieces: list[str]) -> int:
    """The text sent, one token a piece (the relay's count); returns the token count."""
    st_ = dialect.state
    st_.text = {0: list(pieces)} if pieces else {}
    st_.tokens = len(pieces)
    return len(pieces)


@st.composite
def chat_docs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    doc = draw(_extras)
    doc["model"] = draw(_text)
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    if path == CHAT:
        msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _text})
        doc["messages"] = draw(st.lists(msg, min_size=1, max_size=3))
    else:
        doc["prompt"] = draw(_text)
    for key in draw(st.lists(st.sampled_from(["max_tokens", "max_completion_tokens"]))):
        doc[key] = draw(_budget)
    return path, doc


@settings(max_examples=300, deadline=None)
@given(chat_docs(), _pieces)
def test_a_chat_or_completion_continuation_is_json_with_the_model_and_less_budget(
    req: tuple[str, dict[str, Any]], pieces: list[str]
) -> None:
    """Chat and completions: the text sent ends the conversation (an assistant message to
    continue) or the prompt; each of `max_tokens`/`max_completion_tokens` shrinks."""
    path, doc = req
    d = Chat(path, False)
    before = copy.deepcopy(doc)
    tokens = _sent(d, pieces)
    if d.refusal(doc) is not None:
        return
    body = orjson.loads(d.continuation(doc, "vllm").body)
    assert doc == before
    assert body["model"] == doc["model"]
    text = "".join(pieces)
    if path == CHAT:
        assert body["messages"][:-1] == doc["messages"]
        assert body["messages"][-1] == {"role": "assistant", "content": text}
        assert body["continue_final_message"] is True
    else:
        assert body["prompt"] == doc["prompt"] + text
    for key in ("max_tokens", "max_completion_tokens"):
        _budget_ok(doc.get(key), body.get(key), tokens)


_block = st.fixed_dictionaries({"type": st.just("text"), "text": _text})
_content = st.one_of(_text, st.lists(_block, max_size=3))


@st.composite
def messages_docs(draw: st.DrawFn) -> dict[str, Any]:
    doc = draw(_extras)
    doc["model"] = draw(_text)
    turns = draw(st.lists(st.sampled_from(["user", "assistant"]), min_size=1, max_size=4))
    doc["messages"] = [{"role": r, "content": draw(_content)} for r in turns]
    if draw(st.booleans()):
        doc["max_tokens"] = draw(_budget)
    if draw(st.booleans()):
        doc["system"] = draw(st.one_of(_text, st.lists(_block, max_size=2)))
    return doc


@settings(max_examples=300, deadline=None)
@given(messages_docs(), _pieces, st.sampled_from(["vllm", "none"]))
def test_a_messages_continuation_is_json_with_the_model_and_less_budget(
    doc: dict[str, Any], pieces: list[str], resume: str
) -> None:
    """Messages: the `/v1/messages` prefill, or (to vLLM) the chat translation; either way
    the text sent is the last assistant turn's end and `max_tokens` shrinks."""
    d = Messages()
    before = copy.deepcopy(doc)
    tokens = _sent(d, pieces)
    if d.refusal(doc) is not None:
        return
    cont = d.continuation(doc, resume)
    body = orjson.loads(cont.body)
    assert doc == before
    assert body["model"] == doc["model"]
    assert body["messages"][-1]["role"] == "assistant"
    last = body["messages"][-1]["content"]
    text = "".join(pieces)
    if isinstance(last, str):
        assert last.endswith(text)
    else:
        assert last[-1] == {"type": "text", "text": text}
    if cont.path is not None:
        assert resume == "vllm" and body["continue_final_message"] is True
    _budget_ok(doc.get("max_tokens"), body.get("max_tokens"), tokens)


_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system"]), "content": _text, "type": st.just("message")}
)


@st.composite
def responses_docs(draw: st.DrawFn) -> dict[str, Any]:
    doc = draw(_extras.map(lambda d: {k: v for k, v in d.items() if k != "text"}))
    doc["model"] = draw(_text)
    doc["input"] = draw(st.one_of(_text, st.lists(_item, min_size=1, max_size=3)))
    if draw(st.booleans()):
        doc["max_output_tokens"] = draw(_budget)
    return doc


@settings(max_examples=300, deadline=None)
@given(responses_docs(), _pieces)
def test_a_responses_continuation_is_json_with_the_model_and_less_budget(
    doc: dict[str, Any], pieces: list[str]
) -> None:
    """Responses: the input as items plus the text sent as an incomplete assistant
    message, `store` off, `max_output_tokens` shrunk."""
    d = Responses()
    before = copy.deepcopy(doc)
    tokens = _sent(d, pieces)
    if d.refusal(doc) is not None:
        return
    body = orjson.loads(d.continuation(doc, "vllm").body)
    assert doc == before
    assert body["model"] == doc["model"]
    assert body["store"] is False
    partial = body["input"][-1]
    assert partial["role"] == "assistant" and partial["status"] == "incomplete"
    assert partial["content"][0]["text"] == "".join(pieces)
    _budget_ok(doc.get("max_output_tokens"), body.get("max_output_tokens"), tokens)
