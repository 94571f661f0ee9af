"""The official openai client, sync and async, streaming and not, through a real gateway."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from support import Gateway, Sim, backend_entry, fast_probes


@pytest.fixture
def fleet(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> dict[str, Any]:
    sims = [start_sim(n, "--ttft-ms", "5", "--itl-ms", "1") for n in ("a", "b", "c")]
    gw = start_gateway({"backends": [backend_entry(s) for s in sims], "probes": fast_probes()})
    gw.wait_all_ready()
    return {"sims": sims, "gw": gw}


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_sync_chat_matches_the_engine_and_names_the_backend(fleet: dict[str, Any]) -> None:
    """A non-streamed chat through the gateway returns the engine's answer, byte for byte."""
    gw, sims = fleet["gw"], fleet["sims"]
    msgs = [{"role": "user", "content": "tell me about gateways"}]
    raw = _client(gw).chat.completions.with_raw_response.create(
        model="demo-7b", messages=msgs, max_tokens=8, seed=7
    )
    resp = raw.parse()
    backend = raw.headers["x-pulsegate-backend"]
    assert backend in {"a", "b", "c"}
    assert raw.headers["x-pulsegate-attempts"] == "1"
    direct = httpx.post(
        f"{next(s for s in sims if s.name == backend).url}/v1/chat/completions",
        json={"model": "demo-7b", "messages": msgs, "max_tokens": 8, "seed": 7},
        timeout=10,
    ).json()
    assert resp.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert resp.usage is not None and resp.usage.completion_tokens == 8


def test_sync_stream_has_every_token_and_usage(fleet: dict[str, Any]) -> None:
    """A streamed chat delivers all tokens and the usage chunk when asked."""
    stream = _client(fleet["gw"]).chat.completions.create(
        model="demo-7b",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert len(text.split()) == 12
    assert usage is not None and usage.completion_tokens == 12


def test_completions_stream_and_not(fleet: dict[str, Any]) -> None:
    """/v1/completions works streamed and not, with the same deterministic text."""
    c = _client(fleet["gw"])
    full = c.completions.create(model="demo-7b", prompt="once upon", max_tokens=6, seed=3)
    parts = c.completions.create(
        model="demo-7b", prompt="once upon", max_tokens=6, seed=3, stream=True
    )
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text


async def test_async_client_concurrent_requests(fleet: dict[str, Any]) -> None:
    """Many concurrent async requests all succeed and spread over the backends."""
    import asyncio

    client = openai.AsyncOpenAI(
        base_url=f"{fleet['gw'].url}/v1", api_key="unused", max_retries=0, timeout=10
    )

    async def one(i: int) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="demo-7b", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
        )
        raw.parse()
        return raw.headers["x-pulsegate-backend"]

    async def one_stream(i: int) -> int:
        s = await client.chat.completions.create(
            model="demo-7b",
            messages=[{"role": "user", "content": f"s{i}"}],
            max_tokens=5,
            stream=True,
        )
        return len([1 async for c in s if c.choices and c.choices[0].delta.content])

    served = await asyncio.gather(*(one(i) for i in range(60)))
    tokens = await asyncio.gather(*(one_stream(i) for i in range(20)))
    await client.close()
    assert set(served) == {"a", "b", "c"}
    assert tokens == [5] * 20


def test_models_is_the_union_of_backends(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """GET /v1/models lists every model any backend serves, once."""
    a = start_sim("a")
    b = start_sim("b", model="other-1b")
    gw = start_gateway(
        {
            "backends": [
                backend_entry(a),
                {"name": "b", "url": b.url},  # models discovered from /v1/models
            ],
            "probes": fast_probes(),
        }
    )
    gw.wait_all_ready()
    ids = sorted(m.id for m in _client(gw).models.list())
    assert ids == ["demo-7b", "other-1b"]
