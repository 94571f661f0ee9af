"""Streams that survive (R7, R21): a backend dying mid-generation is a pause, not an error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

TOKENS = 60
PROMPT = [{"role": "user", "content": "write a long story about gateways"}]


@pytest.fixture
def fleet(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> dict[str, Any]:
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "15") for n in ("a", "b", "c")}
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims.values()],
            "probes": fast_probes(),
            "streaming": {"stall_timeout": "500ms"},
        }
    )
    gw.wait_all_ready()
    return {"sims": sims, "gw": gw}


def _expected(sim: Sim, body: dict[str, Any]) -> str:
    """The uninterrupted text, asked directly of a healthy engine."""
    r = httpx.post(f"{sim.url}/v1/chat/completions", json={**body, "stream": False}, timeout=10)
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


def _events(resp: httpx.Response) -> Iterator[bytes]:
    buf = b""
    for chunk in resp.iter_bytes():
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            yield ev


def _break(sim: Sim, how: str) -> None:
    if how == "kill":
        sim.kill()
    elif how == "stall":
        sim.fault("stall", after_tokens=1)
    else:
        sim.fault("hang")


@pytest.mark.parametrize("how", ["kill", "stall", "hang"])
def test_stream_survives_backend_failure(fleet: dict[str, Any], how: str) -> None:
    """The client gets every token, the whole text, one id, one [DONE], no error event."""
    gw, sims = fleet["gw"], fleet["sims"]
    body = {
        "model": "demo-7b",
        "messages": PROMPT,
        "max_tokens": TOKENS,
        "seed": 11,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces: list[str] = []
    ids, dones, usage = set(), 0, None
    with httpx.stream(
        "POST", f"{gw.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(15)
    ) as resp:
        assert resp.status_code == 200
        first = resp.headers["x-pulsegate-backend"]
        for ev in _events(resp):
            data = ev.removeprefix(b"data: ")
            if data == b"[DONE]":
                dones += 1
                continue
            obj = orjson.loads(data)
            assert "error" not in obj, obj
            ids.add(obj["id"])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj["choices"]:
                pieces.append(ch["delta"].get("content") or "")
            if len(pieces) == 15:
                _break(sims[first], how)
    healthy = next(s for n, s in sims.items() if n != first)
    assert "".join(pieces) == _expected(healthy, body)
    assert dones == 1 and len(ids) == 1
    assert usage is not None and usage["completion_tokens"] == TOKENS
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert "pulsegate_stream_resumes_total 1" in metrics


def test_openai_client_sees_one_uninterrupted_stream(fleet: dict[str, Any]) -> None:
    """With the official client, a killed backend mid-stream raises nothing."""
    gw, sims = fleet["gw"], fleet["sims"]
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=15)
    with client.chat.completions.with_streaming_response.create(
        model="demo-7b", messages=PROMPT, max_tokens=TOKENS, seed=5, stream=True
    ) as raw:
        first = raw.headers["x-pulsegate-backend"]
        text, n = "", 0
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                n += 1
                if n == 10:
                    sims[first].kill()
    assert n == TOKENS
    healthy = next(s for name, s in sims.items() if name != first)
    expected = _expected(healthy, {"model": "demo-7b", "messages": PROMPT, "max_tokens": TOKENS,
                                   "seed": 5})  # fmt: skip
    assert text == expected


def test_constrained_decoding_is_not_resumed(fleet: dict[str, Any]) -> None:
    """A response_format stream ends with a terminal error event, never silently."""
    gw, sims = fleet["gw"], fleet["sims"]
    body = {
        "model": "demo-7b",
        "messages": PROMPT,
        "max_tokens": TOKENS,
        "stream": True,
        "response_format": {"type": "json_object"},
    }
    events = []
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=15) as resp:
        first = resp.headers["x-pulsegate-backend"]
        for i, ev in enumerate(_events(resp)):
            events.append(ev)
            if i == 5:
                sims[first].kill()
    assert events[-1] == b"data: [DONE]"
    err = orjson.loads(events[-2].removeprefix(b"data: "))
    assert "constrained decoding" in err["error"]["message"]


def test_client_disconnect_cancels_upstream(fleet: dict[str, Any]) -> None:
    """Closing the client stream frees the backend: its in-flight count returns to 0."""
    gw, sims = fleet["gw"], fleet["sims"]
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=15) as resp:
        first = resp.headers["x-pulsegate-backend"]
        for i, _ in enumerate(_events(resp)):
            if i == 3:
                break
    wait_until(lambda: sims[first].stats()["inflight"] == 0, timeout=5, what="upstream freed")
    wait_until(lambda: gw.backends()[first]["inflight"] == 0, timeout=5, what="gateway freed")
