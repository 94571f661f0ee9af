"""Graceful shutdown: in-flight streams finish within the grace, the rest end with an error."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import httpx
import orjson

from support import Gateway, Sim, backend_entry, fast_probes


def _stream(gw: Gateway, tokens: int, out: list[bytes], started: threading.Event) -> None:
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": "a story"}],
        "max_tokens": tokens,
        "stream": True,
    }
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=20) as r:
        for chunk in r.iter_bytes():
            out.append(chunk)
            started.set()


def test_sigterm_finishes_short_streams_and_ends_long_ones_with_an_error(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """A stream that fits the grace completes; one that does not gets an error event and
    [DONE]; nothing ends as a silent 200."""
    sim = start_sim("a", "--ttft-ms", "5", "--itl-ms", "50")
    gw = start_gateway(
        {
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
            "streaming": {"shutdown_grace": "1500ms"},
        }
    )
    gw.wait_all_ready()
    short: list[bytes] = []
    long: list[bytes] = []
    events = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_stream, args=(gw, 10, short, events[0])),  # ~0.5 s
        threading.Thread(target=_stream, args=(gw, 200, long, events[1])),  # ~10 s
    ]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(10)
    gw.signal(signal.SIGTERM)
    for t in threads:
        t.join(20)
    assert gw.popen.wait(timeout=20) == 0
    short_body = b"".join(short)
    assert short_body.endswith(b"data: [DONE]\n\n") and b'"error"' not in short_body
    long_events = b"".join(long).strip().split(b"\n\n")
    assert long_events[-1] == b"data: [DONE]"
    err = orjson.loads(long_events[-2].removeprefix(b"data: "))
    assert "shutting down" in err["error"]["message"]
    try:
        httpx.get(f"{gw.url}/healthz", timeout=2)
        raise AssertionError("the gateway still accepts connections after shutdown")
    except httpx.ConnectError:
        pass
