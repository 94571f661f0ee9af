"""Exact resume (#21 item 7): a stream SIGKILLed mid-way goes on as its token ids.

Three sims behind a real gateway (engine `vllm`, the default). The gateway asks the first
sim for token ids, the sim serves them in vLLM 0.32's framing, and the break continues on
another sim's `/v1/completions` with prompt ids + generated ids: the text must be the
uninterrupted one, and the client never sees an id it did not ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, sse_events

TOKENS = 60
KILL_AT = 15
PROMPT: Any = [{"role": "user", "content": "write a long story about gateways"}]


def _fleet(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], **backend: Any
) -> tuple[Gateway, dict[str, Sim]]:
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "15") for n in ("a", "b", "c")}
    gw = start_gateway(
        {
            "backends": [backend_entry(s, **backend) for s in sims.values()],
            "probes": fast_probes(),
            "streaming": {"stall_timeout": "500ms"},
        }
    )
    gw.wait_all_ready()
    return gw, sims


@pytest.fixture
def fleet(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> tuple[Gateway, dict[str, Sim]]:
    return _fleet(start_sim, start_gateway)


def _uninterrupted(sim: Sim, path: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{sim.url}{path}", json={**body, "stream": False}, timeout=10).json()
    ch = r["choices"][0]
    return ch["message"]["content"] if "message" in ch else ch["text"]  # type: ignore[no-any-return]


def _paths(sim: Sim) -> list[str]:
    """The client requests `sim` received (probes are not listed)."""
    doc = httpx.get(f"{sim.url}/sim/requests", timeout=5).json()
    return [a["path"] for a in doc["requests"]]


def _stream(
    gw: Gateway, sims: dict[str, Sim], path: str, body: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], int, str]:
    """Read a stream raw, SIGKILLing its backend after KILL_AT pieces: (text, chunks,
    `[DONE]`s, the first backend)."""
    text, objs, dones, n = "", [], 0, 0
    with httpx.stream("POST", f"{gw.url}{path}", json=body, timeout=15) as r:
        assert r.status_code == 200
        first = r.headers["x-pulsegate-backend"]
        for ev in sse_events(r):
            data = ev.removeprefix(b"data: ")
            if data == b"[DONE]":
                dones += 1
                continue
            obj = orjson.loads(data)
            assert "error" not in obj, obj
            objs.append(obj)
            for ch in obj["choices"]:
                piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
                if piece:
                    text += piece
                    n += 1
                    if n == KILL_AT:
                        sims[first].kill()
    return text, objs, dones, first


def _ids_seen(objs: list[dict[str, Any]]) -> list[Any]:
    """Every non-null id list in the chunks (top level and per choice)."""
    found = [o["prompt_token_ids"] for o in objs if o.get("prompt_token_ids") is not None]
    for o in objs:
        for ch in o["choices"]:
            found += [ch[k] for k in ("prompt_token_ids", "token_ids") if ch.get(k) is not None]
    return found


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_killed_stream_goes_on_as_token_ids(
    fleet: tuple[Gateway, dict[str, Sim]], path: str
) -> None:
    """Chat and completions: whole uninterrupted text, one id, one [DONE], usage summed, no
    id the client did not ask for, and the continuation was a completions request."""
    gw, sims = fleet
    body: dict[str, Any] = {"model": "demo-7b", "max_tokens": TOKENS, "seed": 11, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if path.endswith("chat/completions"):
        body["messages"] = PROMPT
    else:
        body["prompt"] = "once upon a time a gateway"
    text, objs, dones, first = _stream(gw, sims, path, body)
    others = [s for n, s in sims.items() if n != first]
    assert text == _uninterrupted(others[0], path, body)
    assert dones == 1 and len({o["id"] for o in objs}) == 1
    assert _ids_seen(objs) == []
    usage = objs[-1]["usage"]
    assert usage["completion_tokens"] == TOKENS
    assert usage["prompt_tokens"] == 6  # the prompt's words, the replayed ids not counted
    if path.endswith("chat/completions"):
        assert {o["object"] for o in objs} == {"chat.completion.chunk"}
    continued = [p for s in others for p in _paths(s) if p == "/v1/completions"]
    assert len(continued) == 1 + (0 if "messages" in body else 1)  # + the uninterrupted ask
    assert "pulsegate_stream_resumes_total 1" in httpx.get(f"{gw.url}/metrics", timeout=5).text


def test_openai_client_gets_no_token_ids(fleet: tuple[Gateway, dict[str, Sim]]) -> None:
    """The official client reads one whole stream and finds no token ids on any chunk."""
    gw, sims = fleet
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=15)
    text, n = "", 0
    with client.chat.completions.with_streaming_response.create(
        model="demo-7b", messages=PROMPT, max_tokens=TOKENS, seed=5, stream=True
    ) as raw:
        first = raw.headers["x-pulsegate-backend"]
        for chunk in raw.parse():
            extra = chunk.model_extra or {}
            assert extra.get("prompt_token_ids") is None
            for ch in chunk.choices:
                assert (ch.model_extra or {}).get("token_ids") is None
                if ch.delta.content:
                    text += ch.delta.content
                    n += 1
                    if n == KILL_AT:
                        sims[first].kill()
    survivor = next(s for name, s in sims.items() if name != first)
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": TOKENS, "seed": 5}
    assert n == TOKENS and text == _uninterrupted(survivor, "/v1/chat/completions", body)


def test_client_that_asks_gets_every_id_once(fleet: tuple[Gateway, dict[str, Sim]]) -> None:
    """`return_token_ids` from the client: its ids pass, the continuation's too, and they
    are the uninterrupted answer's ids, each once (none lost or doubled at the seam)."""
    gw, sims = fleet
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": TOKENS, "seed": 3,
            "stream": True, "return_token_ids": True}  # fmt: skip
    text, objs, dones, first = _stream(gw, sims, "/v1/chat/completions", body)
    survivor = next(s for n, s in sims.items() if n != first)
    whole: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{survivor.url}/v1/chat/completions", json=body, timeout=15) as r:
        whole = [orjson.loads(e[6:]) for e in sse_events(r) if e != b"data: [DONE]"]
    assert text == "".join(ch["delta"].get("content") or "" for o in whole for ch in o["choices"])
    gen = [i for o in objs for ch in o["choices"] for i in ch.get("token_ids") or ()]
    want = [i for o in whole for ch in o["choices"] for i in ch.get("token_ids") or ()]
    assert gen == want and len(gen) == TOKENS
    assert [o["prompt_token_ids"] for o in objs if "prompt_token_ids" in o] == [
        whole[0]["prompt_token_ids"]
    ]
    assert dones == 1


def test_exact_resume_off_is_text_replay(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """`exact_resume: false`: no ids asked (no id key on any chunk), the break continues as
    text on chat, and the text is still whole."""
    gw, sims = _fleet(start_sim, start_gateway, exact_resume=False)
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": TOKENS, "seed": 2,
            "stream": True}  # fmt: skip
    text, objs, dones, first = _stream(gw, sims, "/v1/chat/completions", body)
    others = [s for n, s in sims.items() if n != first]
    assert text == _uninterrupted(others[0], "/v1/chat/completions", body)
    assert not any("prompt_token_ids" in o or "token_ids" in o["choices"][0] for o in objs)
    assert [p for s in others for p in _paths(s)].count("/v1/completions") == 0
    assert dones == 1


def test_two_breaks_go_on_from_every_id_once(fleet: tuple[Gateway, dict[str, Sim]]) -> None:
    """The sim serving the first continuation is killed too: the second continuation goes
    on from the prompt and every id generated so far, and the text is still the whole one."""
    gw, sims = fleet
    body = {"model": "demo-7b", "messages": PROMPT, "max_tokens": TOKENS, "seed": 9,
            "stream": True}  # fmt: skip
    text, n, killed = "", 0, []
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=15) as r:
        killed.append(r.headers["x-pulsegate-backend"])
        for ev in sse_events(r):
            if ev == b"data: [DONE]":
                continue
            obj = orjson.loads(ev.removeprefix(b"data: "))
            assert "error" not in obj, obj
            piece = obj["choices"][0]["delta"].get("content") if obj["choices"] else None
            if not piece:
                continue
            text, n = text + piece, n + 1
            if n == KILL_AT:
                sims[killed[0]].kill()
            elif n == 2 * KILL_AT:
                second = next(k for k, s in sims.items() if k != killed[0] and _paths(s))
                killed.append(second)
                sims[second].kill()
    (survivor,) = (s for k, s in sims.items() if k not in killed)
    assert text == _uninterrupted(survivor, "/v1/chat/completions", body)
    assert "pulsegate_stream_resumes_total 2" in httpx.get(f"{gw.url}/metrics", timeout=5).text
