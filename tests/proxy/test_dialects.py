"""Behind an engine with transformers-serve quirks, clients still get OpenAI's behaviour."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from support import Gateway, fast_probes, wait_until

ENGINE = Path(__file__).with_name("hf_like_engine.py")


@pytest.fixture
def gw(start_gateway: Callable[..., Gateway]) -> Iterator[Gateway]:
    proc = subprocess.Popen([sys.executable, str(ENGINE)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        url = "http://" + line.rsplit(" ", 1)[-1].strip()
        g = start_gateway(
            {"backends": [{"name": "hf", "url": url, "models": ["demo-7b"]}],
             "probes": fast_probes()}
        )  # fmt: skip
        wait_until(lambda: g.backends()["hf"]["state"] == "ready", timeout=15, what="hf ready")
        yield g
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


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
