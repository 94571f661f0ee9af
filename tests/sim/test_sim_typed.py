"""The sim's Responses and Anthropic Messages APIs (`sim/typed.py`) through the official
clients, against a real sim process on loopback."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import openai
import pytest

from pulsegate.sim.text import generate

if TYPE_CHECKING:
    from conftest import SimProc

Q = "hello world"


def _oai(sim: SimProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0, timeout=10)


def _claude(sim: SimProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sim.url, api_key="x", max_retries=0, timeout=10)


def test_responses_streamed_and_not_agree_and_follow_the_deterministic_text(sim: SimProc) -> None:
    """The stream's deltas, its completed response and a non-streamed answer all carry
    `generate(input)`; sequence numbers count from 0; usage counts words."""
    want = "".join(generate(Q, 0, 6))
    whole = _oai(sim).responses.create(model="demo-7b", input=Q, max_output_tokens=6)
    assert whole.output_text == want and whole.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (2, 6)
    events = list(
        _oai(sim).responses.create(model="demo-7b", input=Q, max_output_tokens=6, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text


def test_a_continued_assistant_item_splices_exactly(sim: SimProc) -> None:
    """The first k tokens as an incomplete assistant item (vLLM's partial completion) yield
    the remaining n - k tokens of the uninterrupted text."""
    words = generate(Q, 0, 8)
    sent = {"type": "message", "role": "assistant", "status": "incomplete",
            "content": [{"type": "output_text", "text": "".join(words[:3])}]}  # fmt: skip
    body = {"model": "demo-7b", "max_output_tokens": 5,
            "input": [{"role": "user", "content": Q}, sent]}  # fmt: skip
    out = httpx.post(f"{sim.url}/v1/responses", json=body, timeout=10).json()
    assert out["output"][0]["content"][0]["text"] == "".join(words[3:])
    assert out["usage"]["input_tokens"] == 2 + 3  # the replayed words count as prompt


def test_previous_response_id_is_known_only_where_it_was_made(
    sim: SimProc, sim_factory: Any
) -> None:
    """A stored response can be followed up on its sim; another sim answers 404."""
    first = _oai(sim).responses.create(model="demo-7b", input=Q, max_output_tokens=2)
    nxt = _oai(sim).responses.create(
        model="demo-7b", input="more", max_output_tokens=2, previous_response_id=first.id
    )
    assert nxt.previous_response_id == first.id
    other = sim_factory(name="other")
    with pytest.raises(openai.NotFoundError):
        _oai(other).responses.create(
            model="demo-7b", input="more", max_output_tokens=2, previous_response_id=first.id
        )


def test_messages_streamed_and_not_with_a_prefill(sim: SimProc) -> None:
    """The anthropic client reads both; a final assistant message is continued (prefill)."""
    words = generate(Q, 0, 6)
    msgs: Any = [{"role": "user", "content": Q}]
    whole = _claude(sim).messages.create(model="demo-7b", max_tokens=6, messages=msgs)
    assert whole.content[0].text == "".join(words)  # type: ignore[union-attr]
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 6
    with _claude(sim).messages.stream(model="demo-7b", max_tokens=6, messages=msgs) as s:
        assert s.get_final_text() == "".join(words)
    prefill: Any = [*msgs, {"role": "assistant", "content": "".join(words[:2])}]
    rest = _claude(sim).messages.create(model="demo-7b", max_tokens=4, messages=prefill)
    assert rest.content[0].text == "".join(words[2:])  # type: ignore[union-attr]


def test_typed_apis_honour_the_faults(sim: SimProc) -> None:
    """An injected `error` fault is a 500 on both APIs, as on chat."""
    sim.fault("error", rate=1.0)
    with pytest.raises(openai.InternalServerError):
        _oai(sim).responses.create(model="demo-7b", input=Q, max_output_tokens=2)
    with pytest.raises(anthropic.InternalServerError):
        _claude(sim).messages.create(
            model="demo-7b", max_tokens=2, messages=[{"role": "user", "content": Q}]
        )
