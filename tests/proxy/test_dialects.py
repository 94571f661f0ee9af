"""Behind an engine with transformers-serve quirks, clients still get OpenAI's behaviour."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import orjson
import pytest
from script_engines import HF_LIKE, ScriptEngine

from support import Gateway, fast_probes, wait_until


@pytest.fixture
def gw(start_engine: Callable[..., ScriptEngine], start_gateway: Callable[..., Gateway]) -> Gateway:
    engine = start_engine(HF_LIKE)
    g = start_gateway(
        {"backends": [{"name": "hf", "url": engine.url, "models": ["demo-7b"]}],
         "probes": fast_probes()}
    )  # fmt: skip
    wait_until(lambda: g.backends()["hf"]["state"] == "ready", timeout=15, what="hf ready")
    return g


def _events(gw: Gateway, body: dict[str, object]) -> list[bytes]:
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=10) as r:
        raw = r.read()
    return raw.strip().split(b"\n\n")


def test_exactly_one_done_and_no_unasked_usage(gw: Gateway) -> None:
    """The engine sends no [DONE] and always usage: the client gets one [DONE], no usage."""
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
            "stream": True}  # fmt: skip
    evs = _events(gw, body)
    assert evs[-1] == b"data: [DONE]" and evs.count(b"data: [DONE]") == 1
    objs = [orjson.loads(e.removeprefix(b"data: ")) for e in evs[:-1]]
    assert all("usage" not in o for o in objs)
    assert "".join(o["choices"][0]["delta"]["content"] for o in objs) == (
        "alpha beta gamma delta eps"
    )


def test_usage_in_its_own_chunk_when_asked(gw: Gateway) -> None:
    """With include_usage the usage comes in a separate `choices: []` chunk before [DONE]."""
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    evs = _events(gw, body)
    usage = orjson.loads(evs[-2].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert "usage" not in orjson.loads(evs[-3].removeprefix(b"data: "))


def test_fastapi_errors_become_openai_errors(gw: Gateway) -> None:
    """A FastAPI 422 `{"detail": [...]}` reaches the openai client as a typed 400."""
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(
            model="demo-7b",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"frobnicate": True},
        )
    assert "unknown field frobnicate" in str(ei.value)
