"""The stall rule follows the stream's rhythm, and a late first token is hedged: real sims,
a real gateway, the official openai client (docs/stall-and-hedge.md)."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from support import Gateway, Sim, backend_entry, fast_probes, wait_until


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)


def _metric(gw: Gateway, prefix: str) -> float:
    total = 0.0
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stream(
    gw: Gateway,
    max_tokens: int,
    prompt: str = "tell me about rhythm",
    on_first: Callable[[], None] | None = None,
) -> tuple[str, list[float], float, dict[str, str]]:
    """One streamed chat: its text, each content chunk's arrival time, the time to the
    first content and the response headers; `on_first` runs at the first content."""
    t0 = time.monotonic()
    raw = _client(gw).chat.completions.with_raw_response.create(
        model="demo-7b",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
    )
    headers = dict(raw.headers)
    text, times = [], []
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            times.append(time.monotonic())
            if on_first is not None and len(times) == 1:
                on_first()
    return "".join(text), times, (times[0] - t0 if times else float("inf")), headers


def _idle_at(sim: Sim, t0: float, out: list[float]) -> None:
    """Wait (at most 1 s) until `sim` holds no request; note when, since `t0`."""
    wait_until(lambda: sim.stats()["inflight"] == 0, timeout=1.0, what=f"{sim.name} idle")
    out.append(time.monotonic() - t0)


def _zoned(a: Sim, b: Sim, **first: Any) -> list[dict[str, Any]]:
    """`a` (with `first`) in the preferred zone: it takes every first attempt; `b` in the
    other."""
    return [backend_entry(a, zone="z1", **first), backend_entry(b, zone="z2")]


def _probes() -> dict[str, Any]:
    # A 2 s prefill or a 1.5 s late first token must not fail the inference probes.
    return {
        **fast_probes(),
        "micro_inference": {"interval": "4s", "jitter": "200ms", "timeout": "4s"},
        "canary": {"interval": "4s", "timeout": "4s"},
    }


def _gateway(start: Callable[..., Gateway], backends: list[dict[str, Any]], **cfg: Any) -> Gateway:
    gw = start({"backends": backends, "probes": _probes(), "routing": {"prefer_zone": "z1"}, **cfg})
    gw.wait_all_ready()
    return gw


def test_a_stall_at_5ms_between_tokens_is_resumed_within_a_few_hundred_ms(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """(a) 5 ms ITL, the engine stops after 20 tokens: the client's pause is well under the
    1 s stall_timeout (the rhythm cut at ~150 ms, then the resume), and the text is whole."""
    a = start_sim("a", "--itl-ms", "5")
    b = start_sim("b", "--itl-ms", "5")
    gw = _gateway(start_gateway, _zoned(a, b))
    whole, _, _, h = _stream(gw, 60)  # an uninterrupted run on `a`: the reference text
    assert h["x-pulsegate-backend"] == "a"
    a.fault("stall", after_tokens=20)
    text, times, _, _ = _stream(gw, 60)
    pause = max(t2 - t1 for t1, t2 in itertools.pairwise(times))
    print(f"client pause at the stall: {pause * 1000:.0f} ms")
    assert text == whole
    assert _metric(gw, "pulsegate_stream_resumes_total") == 1
    assert pause < 0.6, f"paused {pause * 1000:.0f} ms: the fixed 1 s rule, not the rhythm"


def test_a_slow_but_steady_stream_is_never_cut(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """(b) 200 ms between tokens with somewhere to resume: never cut, never resumed."""
    a = start_sim("a", "--itl-ms", "200")
    b = start_sim("b", "--itl-ms", "200")
    gw = _gateway(start_gateway, _zoned(a, b))
    text, times, _, h = _stream(gw, 12)
    assert h["x-pulsegate-backend"] == "a" and len(times) == 12 and text
    assert _metric(gw, "pulsegate_stream_resumes_total") == 0
    assert _metric(gw, 'pulsegate_requests_total{backend="a",model="demo-7b",code="200"}') >= 1


def test_a_long_prefill_is_not_cut_by_the_rhythm(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """(c) 2 s to the first token, then 5 ms between tokens, on a backend whose rhythm is
    known (an earlier stream): not cut, not resumed."""
    a = start_sim("a", "--ttft-ms", "2000", "--itl-ms", "5")
    b = start_sim("b", "--ttft-ms", "2000", "--itl-ms", "5")
    gw = _gateway(start_gateway, _zoned(a, b))
    for i in range(2):
        # A prompt of its own each time: a prefix-cache hit would shorten the prefill.
        _, times, ttft, h = _stream(gw, 80, f"a long document, part {i}")
        assert h["x-pulsegate-backend"] == "a" and len(times) == 80
        assert ttft >= 1.9
    assert _metric(gw, "pulsegate_stream_resumes_total") == 0


def test_a_late_first_token_is_hedged_on_the_other_backend(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """(d) The preferred backend's first token is 1.5 s late: with retry.hedge on, the
    client's first token comes from the other backend well under 1 s, in one stream of
    bytes, and the late backend's request is closed at once."""
    slow = start_sim("a", "--ttft-ms", "1500")
    fast = start_sim("b", "--ttft-ms", "30")
    gw = _gateway(
        start_gateway,
        _zoned(slow, fast, max_inflight=1),
        retry={"hedge": {"enabled": True, "factor": 2, "budget": 1.0}},
    )
    # Teach the gateway the fleet's usual TTFT: while one long stream holds `a` at its
    # max_inflight, every other stream goes to `b`.
    holder = threading.Thread(target=_stream, args=(gw, 300))
    holder.start()
    wait_until(lambda: slow.stats()["inflight"] >= 1, timeout=5, what="a holds a stream")

    def warm(i: int) -> None:
        for j in range(6):
            _stream(gw, 2, f"warm-up {i}.{j}")

    warmers = [threading.Thread(target=warm, args=(i,)) for i in range(5)]
    for t in warmers:
        t.start()
    for t in warmers:
        t.join(timeout=30)
    holder.join(timeout=30)
    assert not holder.is_alive()
    wait_until(lambda: slow.stats()["inflight"] == 0, timeout=5, what="a idle")
    won = 'pulsegate_hedges_total{outcome="hedge_won"}'
    before = _metric(gw, won)  # the warm-up may have hedged too: b late, a free again
    direct = openai.OpenAI(base_url=f"{fast.url}/v1", api_key="unused", max_retries=0)
    for i in range(4):
        # A prompt of its own each time: a prefix-cache hit would shorten `a`'s prefill.
        prompt = f"question {i}"
        t0 = time.monotonic()
        closed: list[float] = []
        loser_closed = functools.partial(_idle_at, slow, t0, closed)
        text, times, ttft, h = _stream(gw, 20, prompt, loser_closed)
        print(f"hedged TTFT {ttft * 1000:.0f} ms from {h['x-pulsegate-backend']}")
        assert ttft < 0.9 and h["x-pulsegate-backend"] == "b" and len(times) == 20
        # One stream of bytes: exactly what `b` alone says to this prompt.
        alone = direct.chat.completions.create(
            model="demo-7b", messages=[{"role": "user", "content": prompt}], max_tokens=20
        )
        assert text == alone.choices[0].message.content
        assert closed and closed[0] < 1.4
    assert _metric(gw, won) - before == 4
