"""Real vLLM's `/v1/responses` and `/v1/messages` streams, SIGKILLed mid-generation.

Twenty Responses and twenty Messages streams run at once on one vLLM (one session key),
which is SIGKILLed once every one has 100 tokens; all continue on the other vLLM, and every
text must be the uninterrupted greedy text. Responses: vLLM continues an input ending with an
`incomplete` assistant message (its partial-message completion). Messages: vLLM's own
`/v1/messages` starts a new turn after a final assistant message (no prefill), so the
gateway continues through its `/v1/chat/completions` with `continue_final_message` and maps
the chunks back into Anthropic events (docs/streams.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import orjson
import pytest
from engine_kit import MODEL, EnginePool, record_figures
from test_real_faults import ENGINE_S, pair  # noqa: F401 - the fixture

from support import Gateway, sse_events, wait_until

TOKENS = 400
KILL_AFTER = 100  # characters (one token each with this tokenizer) read before the kill
PER_API = 20  # streams of each API
SESSION = {"x-session-id": "typed-real"}
Q = "hello world"


def _bodies() -> dict[str, dict[str, Any]]:
    return {
        "/v1/responses": {"model": MODEL, "input": Q, "max_output_tokens": TOKENS,
                          "temperature": 0},
        "/v1/messages": {"model": MODEL, "max_tokens": TOKENS, "temperature": 0,
                         "messages": [{"role": "user", "content": Q}]},
    }  # fmt: skip


def _text(path: str, obj: dict[str, Any]) -> str:
    if path == "/v1/responses":
        return obj["output"][0]["content"][0]["text"]  # type: ignore[no-any-return]
    return obj["content"][0]["text"]  # type: ignore[no-any-return]


def _state(gw: Gateway, name: str) -> str:
    doc = httpx.get(f"{gw.url}/admin/backends", timeout=10).json()
    return next(str(b["state"]) for b in doc["backends"] if b["name"] == name)


class Stream:
    def __init__(self, gw: Gateway, path: str, body: dict[str, Any]) -> None:
        self.path, self.events, self.text, self.backend = path, [], "", ""
        self.events: list[tuple[str, dict[str, Any]]]
        self.gap = 0.0  # the longest wait between two events: the seam, after the kill
        self.last = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(gw, body), daemon=True)

    def _run(self, gw: Gateway, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{gw.url}{self.path}", json={**body, "stream": True},
                              headers=SESSION, timeout=120) as r:  # fmt: skip
                assert r.status_code == 200, r.read()
                self.backend = r.headers["x-pulsegate-backend"]
                for raw in sse_events(r):
                    now = time.monotonic()
                    if self.last:
                        self.gap = max(self.gap, now - self.last)
                    self.last = now
                    name, _, data = raw.partition(b"\ndata: ")
                    obj = orjson.loads(data)
                    self.events.append((name.removeprefix(b"event: ").decode(), obj))
                    if obj.get("type") == "response.output_text.delta":
                        self.text += obj["delta"]
                    elif obj.get("type") == "content_block_delta":
                        self.text += obj["delta"].get("text") or ""
        except BaseException as e:
            self.error = e


@pytest.mark.timeout(600)
def test_killed_vllm_typed_streams_resume(pool: EnginePool, pair: Gateway) -> None:  # noqa: F811
    """Every stream arrives whole in its framing (one created/start, one terminal event,
    sequence numbers increasing, one id) and every text is the uninterrupted one."""
    gw = pair
    for name in ("vllm-a", "vllm-b"):
        pool.get(name, timeout=ENGINE_S)
    gw.wait_all_ready(timeout=60)
    survivor_url = pool.get("vllm-b").url
    expected = {
        p: _text(p, httpx.post(f"{survivor_url}{p}", json=b, timeout=120).json())
        for p, b in _bodies().items()
    }
    # Every stream starts on vllm-a (vllm-b drained: 40 streams would otherwise spill over
    # both), then vllm-b takes them all once vllm-a is killed.
    admin = f"{gw.url}/admin/backends/vllm-b"
    assert httpx.post(f"{admin}/drain", timeout=10).status_code == 200
    streams = [Stream(gw, p, b) for p, b in _bodies().items() for _ in range(PER_API)]
    for s in streams:
        s.thread.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(len(s.text) >= KILL_AFTER for s in streams):
        assert not any(s.error for s in streams), [repr(s.error) for s in streams]
        time.sleep(0.01)
    assert httpx.post(f"{admin}/undrain", timeout=10).status_code == 200
    wait_until(lambda: _state(gw, "vllm-b") == "ready", timeout=10)
    serving = {s.backend for s in streams}
    assert len(serving) == 1, serving
    (victim,) = serving
    assert all(len(s.text) < TOKENS for s in streams), "a stream ended before the kill"
    pool.engines[victim].kill()
    for s in streams:
        s.thread.join(timeout=180)
        assert s.error is None, (s.path, repr(s.error))
    for resp in streams[:PER_API]:
        types = [o["type"] for _, o in resp.events]
        assert types.count("response.created") == 1 and types[-1] == "response.completed"
        assert not {"response.failed", "error"} & set(types)
        seqs = [o["sequence_number"] for _, o in resp.events]
        assert seqs == sorted(set(seqs)), seqs[:20]
        assert len({o["item_id"] for _, o in resp.events if "item_id" in o}) == 1
        assert resp.events[-1][1]["response"]["id"] == resp.events[0][1]["response"]["id"]
    for msgs in streams[PER_API:]:
        mtypes = [o["type"] for _, o in msgs.events]
        assert mtypes.count("message_start") == 1 and mtypes[-1] == "message_stop"
        assert mtypes.count("message_stop") == 1 and "error" not in mtypes
        assert mtypes.count("message_delta") == 1
        idx = {o["index"] for _, o in msgs.events if o["type"].startswith("content_block")}
        assert idx == {0}
    gaps = sorted(s.gap for s in streams)
    whole = {p: sum(s.text == expected[p] for s in streams if s.path == p) for p in expected}
    record_figures(
        "vLLM SIGKILLed mid-stream, 20 Responses and 20 Messages streams",
        {
            "responses whole and == uninterrupted": f"{whole['/v1/responses']}/{PER_API}",
            "messages whole and == uninterrupted": f"{whole['/v1/messages']}/{PER_API}",
            "seam pause p50 / max (s)": (round(gaps[len(gaps) // 2], 3), round(gaps[-1], 3)),
            "usage (a responses stream)": streams[0].events[-1][1]["response"].get("usage"),
            "usage (a messages stream)": next(
                o for t, o in streams[-1].events if t == "message_delta"
            )["usage"],
        },
    )
    assert whole == {p: PER_API for p in expected}, whole
