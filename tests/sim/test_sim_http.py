"""The OpenAI-compatible surface of a real sim process on loopback."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pulsegate.sim.text import generate

if TYPE_CHECKING:  # helpers live in conftest.py until the lead moves them to tests/support.py
    from conftest import SimProc

MSGS: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "you are terse"},
    {"role": "user", "content": "hello world"},
]


def _client(sim: SimProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0, timeout=10)


def _sse_events(body: bytes) -> list[bytes]:
    """Split an SSE body into its `data:` payloads, asserting vLLM's exact framing."""
    assert body.endswith(b"\n\n")
    events = body[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events)
    return [e[6:] for e in events]


def test_chat_non_stream_with_openai_client(sim: SimProc) -> None:
    """A chat completion has the OpenAI shape, deterministic text and word-count usage."""
    r = _client(sim).chat.completions.create(model="demo-7b", messages=MSGS, max_tokens=5)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == "demo-7b" and r.created > 0
    assert r.choices[0].message.content == "".join(generate("hello world", 0, 5))
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 5)


async def test_chat_stream_with_async_openai_client(sim: SimProc) -> None:
    """Async streaming: role chunk first, one chunk per token, usage chunk when asked."""
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="demo-7b",
        messages=MSGS,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [c.choices[0].delta.content for c in chunks[1:5]]
    assert tokens == generate("hello world", 0, 4)
    assert chunks[4].choices[0].finish_reason == "length"
    assert chunks[5].choices == [] and chunks[5].usage is not None
    assert chunks[5].usage.completion_tokens == 4
    assert len(chunks) == 6


def test_completions_stream_framing_raw(sim: SimProc) -> None:
    """Raw bytes: `data: {json}\\n\\n` per chunk, exactly one [DONE], no usage unless asked."""
    body = {"model": "demo-7b", "prompt": "a b", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=5) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = _sse_events(raw)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == generate("a b", 0, 3)
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    assert all(c["id"].startswith("cmpl-") for c in chunks)

    body["stream_options"] = {"include_usage": True}
    events = _sse_events(httpx.post(f"{sim.url}/v1/completions", json=body, timeout=5).content)
    usage = orjson.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert events.count(b"[DONE]") == 1


def test_completion_resume_continues_exactly(sim: SimProc) -> None:
    """Re-sending prompt + first k tokens' text yields exactly the remaining tokens."""
    client = _client(sim)
    full = client.completions.create(model="demo-7b", prompt="the quick fox", max_tokens=12)
    text = full.choices[0].text
    toks = [" " + w for w in text.split()]
    for k in (0, 1, 5, 11):
        rest = client.completions.create(
            model="demo-7b", prompt="the quick fox" + "".join(toks[:k]), max_tokens=12 - k
        )
        assert rest.choices[0].text == "".join(toks[k:])


def test_chat_continue_final_message_resumes(sim: SimProc) -> None:
    """A partial assistant message with continue_final_message continues, not repeats."""
    client = _client(sim)
    full = client.chat.completions.create(model="demo-7b", messages=MSGS, max_tokens=10, seed=7)
    text = full.choices[0].message.content or ""
    cut = len(" ".join(text.split()[:4])) + 1  # first 4 words with their leading space
    partial = text[:cut]
    rest = client.chat.completions.create(
        model="demo-7b",
        messages=[*MSGS, {"role": "assistant", "content": partial}],
        max_tokens=6,
        seed=7,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert partial + (rest.choices[0].message.content or "") == text


def test_request_seed_and_engine_seed(sim: SimProc, sim_factory: Callable[..., SimProc]) -> None:
    """The request seed picks the text; without one the engine's --seed is used."""
    body = {"prompt": "p q", "max_tokens": 6}
    seeded = httpx.post(f"{sim.url}/v1/completions", json={**body, "seed": 3}, timeout=5).json()
    assert seeded["choices"][0]["text"] == "".join(generate("p q", 3, 6))
    other = sim_factory("--seed", "3", "--ttft-ms", "0", "--itl-ms", "0", name="seed3")
    default = httpx.post(f"{other.url}/v1/completions", json=body, timeout=5).json()
    assert default["choices"][0]["text"] == seeded["choices"][0]["text"]


@pytest.mark.parametrize(
    ("path", "payload", "status", "needle"),
    [
        ("/v1/chat/completions", b"{bad", 400, "Invalid JSON"),
        ("/v1/chat/completions", b'{"model": "demo-7b"}', 400, "messages"),
        ("/v1/completions", b'{"model": "demo-7b"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "`nope` does not exist"),
    ],
)
def test_errors_are_openai_shaped(
    sim: SimProc, path: str, payload: bytes, status: int, needle: str
) -> None:
    """Bad requests get {"error": {message, type, code}} with a fitting status."""
    r = httpx.post(f"{sim.url}{path}", content=payload, timeout=5)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


def test_openai_client_sees_404_for_unknown_model(sim: SimProc) -> None:
    """The SDK raises NotFoundError for a model the engine does not serve."""
    with pytest.raises(openai.NotFoundError):
        _client(sim).completions.create(model="other", prompt="x")


def test_models_and_health(sim: SimProc) -> None:
    """/v1/models lists the model owned by pulsegate-sim; /health is 200 with no body."""
    models = _client(sim).models.list()
    assert [m.id for m in models.data] == ["demo-7b"]
    assert models.data[0].owned_by == "pulsegate-sim"
    r = httpx.get(f"{sim.url}/health", timeout=5)
    assert (r.status_code, r.content) == (200, b"")


def test_metrics_count_work(sim: SimProc) -> None:
    """Success and generation-token counters advance; max_batch is exported."""
    before = sim.metrics()
    _client(sim).completions.create(model="demo-7b", prompt="m n", max_tokens=7)
    after = sim.metrics()
    label = '{model_name="demo-7b"}'
    assert after[f"vllm:request_success_total{label}"] == (
        before[f"vllm:request_success_total{label}"] + 1
    )
    assert after[f"vllm:generation_tokens_total{label}"] == (
        before[f"vllm:generation_tokens_total{label}"] + 7
    )
    assert after[f"pulsegate_sim_max_batch{label}"] == 32
    gpu = '{gpu="0",modelName="NVIDIA H100 80GB HBM3"}'
    assert after[f"DCGM_FI_DEV_FB_FREE{gpu}"] + after[f"DCGM_FI_DEV_FB_USED{gpu}"] == 81920


async def test_zero_delay_engine_serves_a_burst(sim_factory: Callable[..., SimProc]) -> None:
    """ttft 0 / itl 0: 200 concurrent 16-token streams all complete, each with its [DONE].
    (How fast is a benchmark's business: bench/, not a timed assert here.)"""
    zero = sim_factory("--ttft-ms", "0", "--itl-ms", "0", name="zero")
    body = {"prompt": "z z", "stream": True}
    async with httpx.AsyncClient(base_url=zero.url, timeout=30) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(200)))
    assert all(r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n") for r in rs)


def test_sigterm_exits_zero(sim_factory: Callable[..., SimProc]) -> None:
    """The process prints its listening line (port 0 -> real port) and exits 0 on SIGTERM."""
    sp = sim_factory(name="term")
    assert not sp.url.endswith(":0")
    assert httpx.get(f"{sp.url}/health", timeout=5).status_code == 200
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(timeout=5) == 0
