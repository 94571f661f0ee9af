"""Probe bodies: the canary prompt's size, shape and reproducibility."""

from __future__ import annotations

import random

import orjson
import pytest

from pulsegate.probers.payload import Api, CanaryText, canary_body, micro_body, probe_api


@pytest.mark.parametrize("size", [0, 1500, 4096, 6144, 8192, 65536])
@pytest.mark.parametrize("api", [Api.COMPLETIONS, Api.CHAT])
def test_canary_body_reaches_payload_bytes(size: int, api: Api) -> None:
    """Every body is at least payload_bytes and at most one excerpt over it."""
    text = CanaryText(random.Random(1), size)
    body = canary_body(text, "meta-llama/Llama-3.1-70B-Instruct", api, size)
    assert size <= len(body) <= max(size, 600) + 400
    req = orjson.loads(body)
    assert req["max_tokens"] == 1 and req["user"] == "pulsegate-canary"
    assert ("prompt" in req) is (api is Api.COMPLETIONS)


@pytest.mark.parametrize("size", [0, 1500, 6144, 65536])
def test_embedding_canary_is_one_passage_of_payload_bytes(size: int) -> None:
    """An embedding model's canary is the same prompt as one `input`, flagged synthetic."""
    body = canary_body(CanaryText(random.Random(1), size), "bge-small", Api.EMBEDDINGS, size)
    assert size <= len(body) <= max(size, 600) + 400
    req = orjson.loads(body)
    assert isinstance(req["input"], str) and req["user"] == "pulsegate-canary"
    assert "max_tokens" not in req and "messages" not in req


def test_probe_api_follows_the_backend_apis() -> None:
    """Completions first, then chat, then embeddings; neither: completions (its 404 shows)."""
    assert probe_api(("chat", "completions")) is Api.COMPLETIONS
    assert probe_api(("chat", "responses")) is Api.CHAT
    assert probe_api(("embeddings",)) is Api.EMBEDDINGS
    assert probe_api(("rerank",)) is Api.COMPLETIONS
    assert orjson.loads(micro_body("m", Api.EMBEDDINGS)) == {"model": "m", "input": "ping"}


def test_canary_chat_body_has_system_and_user_turns() -> None:
    """The chat form is a system prompt plus a customer question, plain printable ASCII."""
    body = canary_body(CanaryText(random.Random(2), 6144), "m", Api.CHAT, 6144)
    msgs = orjson.loads(body)["messages"]
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"].endswith("?")
    assert body.decode("ascii").isprintable()


def test_canary_text_is_reproducible_per_seed() -> None:
    """The same seed gives the same prompt; another seed a different one."""
    a = canary_body(CanaryText(random.Random(3), 6144), "m", Api.COMPLETIONS, 6144)
    b = canary_body(CanaryText(random.Random(3), 6144), "m", Api.COMPLETIONS, 6144)
    c = canary_body(CanaryText(random.Random(4), 6144), "m", Api.COMPLETIONS, 6144)
    assert a == b != c


def test_micro_body_is_the_documented_ping() -> None:
    """The micro-inference asks one deterministic token for 'ping'."""
    assert orjson.loads(micro_body("m", Api.COMPLETIONS)) == {
        "model": "m",
        "prompt": "ping",
        "max_tokens": 1,
        "temperature": 0,
    }
    chat = orjson.loads(micro_body("m", Api.CHAT))
    assert chat["messages"] == [{"role": "user", "content": "ping"}]
