"""Streams that survive (R7, R21): a backend dying mid-generation is a pause, not an error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
from script_engines import VLLM_LIKE, ScriptEngine

from support import Gateway, Sim, backend_entry, fast_probes, sse_events, wait_until

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
        for ev in sse_events(resp):
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
        for i, ev in enumerate(sse_events(resp)):
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
        for i, _ in enumerate(sse_events(resp)):
            if i == 3:
                break
    wait_until(lambda: sims[first].stats()["inflight"] == 0, timeout=5, what="upstream freed")
    wait_until(lambda: gw.backends()[first]["inflight"] == 0, timeout=5, what="gateway freed")


def _read_stream(
    gw: Gateway,
    body: dict[str, Any],
    on_event: Callable[[int, httpx.Response], None] | None = None,
) -> tuple[str, list[dict[str, Any]], list[bytes]]:
    """(text, JSON chunks, raw events) of one streamed chat through the gateway;
    `on_event(count, response)` after each event."""
    text, objs, events = "", [], []
    with httpx.stream(
        "POST", f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        for ev in sse_events(resp):
            events.append(ev)
            data = ev.removeprefix(b"data: ")
            if data != b"[DONE]":
                obj = orjson.loads(data)
                objs.append(obj)
                for ch in obj.get("choices") or ():
                    text += ch["delta"].get("content") or ""
            if on_event is not None:
                on_event(len(events), resp)
    return text, objs, events


def test_resume_counts_tokens_not_events(
    start_engine: Callable[..., ScriptEngine], start_gateway: Callable[..., Gateway]
) -> None:
    """An engine that sends 4 tokens per event is killed mid-stream: the continuation is
    asked for exactly the tokens still missing (counted with the target's /tokenize), so
    the client's text is the uninterrupted text and usage says max_tokens."""
    engines = {n: start_engine(VLLM_LIKE, "--merge", "4", "--itl-ms", "10") for n in "ab"}
    gw = start_gateway(
        {
            "backends": [
                {"name": n, "url": e.url, "models": ["demo-7b"]} for n, e in engines.items()
            ],
            "probes": fast_probes(),
            "streaming": {"stall_timeout": "500ms"},
        }
    )
    gw.wait_all_ready()
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    direct = httpx.post(f"{engines['a'].url}/v1/chat/completions", json=body, timeout=10).json()
    expected = direct["choices"][0]["message"]["content"]
    killed: list[str] = []

    def kill(count: int, resp: httpx.Response) -> None:
        if count == 6:  # the role chunk, then 5 events of 4 tokens: 20 tokens sent
            killed.append(resp.headers["x-pulsegate-backend"])
            engines[killed[0]].kill()

    body = {**body, "stream_options": {"include_usage": True}}
    text, objs, events = _read_stream(gw, body, kill)
    assert killed, "the stream ended before the kill"
    assert [o["error"] for o in objs if "error" in o] == []
    assert events.count(b"data: [DONE]") == 1
    assert text == expected and len(text) == TOKENS
    (usage,) = [o["usage"] for o in objs if o.get("usage")]
    assert usage["completion_tokens"] == TOKENS
    assert usage["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert "pulsegate_stream_resumes_total 1" in metrics


def test_slow_stream_with_nowhere_to_go_is_not_cut(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """The only backend is slower than the stall timeout between every two tokens: with no
    other backend to continue on, the stream is left to finish instead of being cut."""
    sim = start_sim("only", "--ttft-ms", "1", "--itl-ms", "10")
    gw = start_gateway(
        {
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
            "streaming": {"stall_timeout": "200ms"},
        }
    )
    gw.wait_all_ready()
    sim.fault("slow", factor=50)  # 500 ms between tokens, 2.5x the stall timeout
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": 4}
    text, objs, events = _read_stream(gw, body)
    assert [o["error"] for o in objs if "error" in o] == []
    assert events.count(b"data: [DONE]") == 1 and events[-1] == b"data: [DONE]"
    assert text
    assert sum(bool(ch["delta"].get("content")) for o in objs for ch in o["choices"]) == 4


def test_stalled_stream_with_nowhere_to_go_ends_at_the_request_deadline(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """A stream of the only backend that stops for good is cut at the request's own deadline
    (retry.request_timeout), not at the first stall, and ends with an error event."""
    sim = start_sim("only", "--ttft-ms", "1", "--itl-ms", "10")
    # The stall fault also stalls the probes, which would eject the backend (and an ejected
    # backend's idle stream is cut at once: the test below); here only the deadline acts.
    fast = fast_probes()
    probes = {
        **fast,
        "canary": {"interval": "1h", "timeout": "250ms"},
        "micro_inference": {**fast["micro_inference"], "failures_to_eject": 100},
    }
    gw = start_gateway(
        {
            "backends": [backend_entry(sim)],
            "probes": probes,
            "streaming": {"stall_timeout": "200ms"},
            "retry": {"per_try_timeout": "1s", "request_timeout": "1500ms"},
        }
    )
    gw.wait_all_ready()
    sim.fault("stall", after_tokens=2)
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": 10}
    _, objs, events = _read_stream(gw, body)
    errors = [o["error"]["message"] for o in objs if "error" in o]
    assert len(errors) == 1 and "request deadline reached" in errors[0], errors
    assert events[-1] == b"data: [DONE]"


def test_stalled_stream_of_an_ejected_backend_ends_at_once_with_nowhere_to_go(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Waiting out a quiet stream with nowhere to go is for a slow engine, not a sick one:
    once the health core ejects the backend, the idle stream ends with an error event instead
    of holding its client until the request deadline (60 s here, past the client's 30 s)."""
    sim = start_sim("only", "--ttft-ms", "1", "--itl-ms", "10")
    gw = start_gateway(
        {
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
            "streaming": {"stall_timeout": "200ms"},
            "retry": {"request_timeout": "60s"},
        }
    )
    gw.wait_all_ready()
    sim.fault("stall", after_tokens=2)
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": 10}

    def eject_after_two(count: int, _resp: httpx.Response) -> None:
        if count == 3:  # the role chunk and two tokens: the stream is stalled now
            r = httpx.post(f"{gw.url}/admin/backends/only/eject", timeout=5)
            r.raise_for_status()

    _, objs, events = _read_stream(gw, body, eject_after_two)
    errors = [o["error"]["message"] for o in objs if "error" in o]
    assert len(errors) == 1 and "ejected" in errors[0], errors
    assert events[-1] == b"data: [DONE]"
