"""OpenAI field checks at the edge, and stop strings cut the OpenAI way for every engine."""

from __future__ import annotations

import orjson
import pytest

from pulsegate.proxy.stops import StopFilter, cut_answer, stop_strings
from pulsegate.proxy.validate import invalid_field

MSGS = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"temperature": -1}, "'temperature'"),
        ({"max_tokens": "ten"}, "'max_tokens'"),
        ({"n": 0}, "'n'"),
        ({"stream": "yes"}, "'stream'"),
        ({"stop": [1]}, "'stop'"),
        ({"stop": ["x"] * 280_000}, "at most 32 strings"),
        ({"stop": "y" * 257}, "at most 256 characters"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ],
)
def test_bad_fields_are_named(extra: dict[str, object], needle: str) -> None:
    """Each bad standard field is refused with its name (a client error, not the engine's)."""
    why = invalid_field({"model": "m", "messages": MSGS, **extra}, chat=True)
    assert why is not None and needle in why


def test_valid_request_and_unknown_fields_pass() -> None:
    """Valid values and fields OpenAI does not define are left to the engine."""
    doc = {"model": "m", "messages": MSGS, "temperature": 0.7, "max_tokens": 5, "x_custom": 1}
    assert invalid_field(doc, chat=True) is None


def test_non_streamed_answer_is_cut_before_the_stop() -> None:
    """A stopped choice loses its stop string and what follows; others are untouched."""
    body = orjson.dumps(
        {"choices": [{"index": 0, "finish_reason": "stop", "text": "one two END three"}]}
    )
    out = orjson.loads(cut_answer(body, stop_strings({"stop": ["END"]})))
    assert out["choices"][0]["text"] == "one two "
    assert cut_answer(body, ("nothere",)) == body


def test_stream_filter_holds_back_a_possible_stop_across_chunks() -> None:
    """'EN' + 'D' across two chunks is still a stop; no text after it is sent."""
    f = StopFilter(("END",))
    sent = ""
    for piece, finish in (("one E", None), ("N", None), ("D more", None), ("", "length")):
        obj = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}
        out = f.feed(obj)
        if out is not None:
            sent += out["choices"][0]["delta"].get("content") or ""
            last = out
    assert sent == "one "
    assert last["choices"][0]["finish_reason"] == "stop"
