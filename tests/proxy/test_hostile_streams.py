"""A backend that writes what is not SSE into a stream: the client never sees those bytes.

Found on the landed code (issue #22): an HTML page, binary or invalid UTF-8 written into a
stream went straight to the client, whose official `openai` client then raised
`UnicodeDecodeError` mid-stream; one event without its blank line grew without bound. Now
each is a broken stream: cut, counted against the backend, and resumed on a healthy one, so
the client's text is whole and exactly what one engine would have produced.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
from script_engines import HERE, VLLM_LIKE, ScriptEngine
from vllm_like_engine import MODEL, text_at

from support import Gateway, fast_probes

HOSTILE = HERE / "hostile_engine.py"
TOKENS = 12


@pytest.mark.parametrize("fault", ["html", "binary", "utf8", "endless", "choices"])
def test_non_sse_bytes_never_reach_the_client(
    fault: str,
    start_engine: Callable[..., ScriptEngine],
    start_gateway: Callable[..., Gateway],
) -> None:
    """Streams first sent to the hostile backend arrive whole through the official client,
    continued on the healthy one; the fault's bytes are never in what the client read."""
    bad, good = start_engine(HOSTILE), start_engine(VLLM_LIKE, "--merge", "1", "--itl-ms", "1")
    gw = start_gateway(
        {
            "backends": [
                {"name": "bad", "url": f"{bad.url}/{fault}", "models": [MODEL]},
                {"name": "good", "url": good.url, "models": [MODEL]},
            ],
            "probes": fast_probes(),
        }
    )
    gw.wait_all_ready()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=20)
    hit_bad = 0
    for i in range(16):
        with client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=TOKENS,
            stream=True,
            extra_headers={"x-session-id": f"s{i}"},
        ) as resp:
            first = resp.headers["x-pulsegate-backend"]
            raw = b"".join(resp.iter_bytes())
        assert b"<html>" not in raw and b"\xff" not in raw and b"aaaa" not in raw, raw[:300]
        assert b'"choices":[1]' not in raw
        raw.decode()  # what reached the client is UTF-8
        text = "".join(
            c.choices[0].delta.content or ""
            for c in _chunks(raw)
            if c.choices and c.choices[0].delta
        )
        assert text == text_at(0, TOKENS), (first, raw[-300:])
        assert raw.rstrip().endswith(b"data: [DONE]")
        if first == "bad":
            hit_bad += 1
            if hit_bad >= 2:
                break
    assert hit_bad >= 1, "no stream started on the hostile backend: the test proved nothing"
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert 'pulsegate_requests_total{backend="bad",model="demo-7b",code="stream_broken"}' in metrics


def _chunks(raw: bytes) -> list[openai.types.chat.ChatCompletionChunk]:
    out = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: ") and ev != b"data: [DONE]":
            out.append(openai.types.chat.ChatCompletionChunk.model_validate_json(ev[6:]))
    return out
