"""Real vLLM's `/v1/responses` and `/v1/messages` streams, SIGKILLed mid-generation.

One Responses and one Messages stream run at once on one vLLM (one session key), which is
SIGKILLed once both have 200 tokens; both continue on the other vLLM, and both texts must
be the uninterrupted greedy text. Responses: vLLM continues an input ending with an
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

from support import Gateway, sse_events

TOKENS = 800
KILL_AFTER = 200  # characters (one token each with this tokenizer) read before the kill
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


class Stream:
    def __init__(self, gw: Gateway, path: str, body: dict[str, Any]) -> None:
        self.path, self.events, self.text, self.backend = path, [], "", ""
        self.events: list[tuple[str, dict[str, Any]]]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(gw, body), daemon=True)

    def _run(self, gw: Gateway, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{gw.url}{self.path}", json={**body, "stream": True},
                              headers=SESSION, timeout=120) as r:  # fmt: skip
                assert r.status_code == 200, r.read()
                self.backend = r.headers["x-pulsegate-backend"]
                for raw in sse_events(r):
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
    """Both streams arrive whole in their framing (one created/start, one terminal event,
    sequence numbers increasing, one id) and both texts are the uninterrupted ones."""
    gw = pair
    for name in ("vllm-a", "vllm-b"):
        pool.get(name, timeout=ENGINE_S)
    gw.wait_all_ready(timeout=60)
    survivor_url = pool.get("vllm-b").url
    expected = {
        p: _text(p, httpx.post(f"{survivor_url}{p}", json=b, timeout=120).json())
        for p, b in _bodies().items()
    }
    streams = [Stream(gw, p, b) for p, b in _bodies().items()]
    for s in streams:
        s.thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(len(s.text) >= KILL_AFTER for s in streams):
        assert not any(s.error for s in streams), [repr(s.error) for s in streams]
        time.sleep(0.01)
    serving = {s.backend for s in streams}
    assert len(serving) == 1, serving
    (victim,) = serving
    assert all(len(s.text) < TOKENS for s in streams), "a stream ended before the kill"
    pool.engines[victim].kill()
    for s in streams:
        s.thread.join(timeout=180)
        assert s.error is None, (s.path, repr(s.error))
    resp, msgs = streams
    types = [o["type"] for _, o in resp.events]
    assert types.count("response.created") == 1 and types[-1] == "response.completed"
    assert not {"response.failed", "error"} & set(types)
    seqs = [o["sequence_number"] for _, o in resp.events]
    assert seqs == sorted(set(seqs)), seqs[:20]
    assert len({o["item_id"] for _, o in resp.events if "item_id" in o}) == 1
    assert resp.events[-1][1]["response"]["id"] == resp.events[0][1]["response"]["id"]
    mtypes = [o["type"] for _, o in msgs.events]
    assert mtypes.count("message_start") == 1 and mtypes[-1] == "message_stop"
    assert mtypes.count("message_stop") == 1 and "error" not in mtypes
    assert mtypes.count("message_delta") == 1
    assert {o["index"] for _, o in msgs.events if o["type"].startswith("content_block")} == {0}
    record_figures(
        "vLLM SIGKILLed mid-stream, Responses and Messages",
        {
            "responses text == uninterrupted": resp.text == expected["/v1/responses"],
            "messages text == uninterrupted": msgs.text == expected["/v1/messages"],
            "chars received (responses, messages)": (len(resp.text), len(msgs.text)),
            "usage (responses)": resp.events[-1][1]["response"].get("usage"),
            "usage (messages)": next(o for t, o in msgs.events if t == "message_delta")["usage"],
        },
    )
    assert resp.text == expected["/v1/responses"]
    assert msgs.text == expected["/v1/messages"]
