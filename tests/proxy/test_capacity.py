"""Capacity-aware routing (R24, R25): limits hold, the gateway queues, then says 503."""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Callable

import httpx

from support import Gateway, Sim, backend_entry, fast_probes, wait_until


def _chat(gw: Gateway, tokens: int) -> httpx.Response:
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": tokens,
    }
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=20)


def _fleet(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], queue_timeout: str
) -> tuple[Gateway, list[Sim]]:
    sims = [start_sim(n, "--ttft-ms", "5", "--itl-ms", "20") for n in ("a", "b")]
    gw = start_gateway(
        {
            "backends": [backend_entry(s, max_inflight=2) for s in sims],
            "probes": fast_probes(),
            "routing": {"queue_timeout": queue_timeout, "min_ready": 3},
        }
    )
    gw.wait_all_ready()
    return gw, sims


def test_requests_wait_for_capacity_and_limits_hold(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """12 concurrent requests on 2 backends limited to 2 each: all succeed, some queued,
    and the gateway never has more than 2 in flight on either backend."""
    gw, _ = _fleet(start_sim, start_gateway, "5s")
    peak = {"a": 0, "b": 0}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futs = [pool.submit(_chat, gw, 15) for _ in range(12)]
        while not all(f.done() for f in futs):
            for name, b in gw.backends().items():
                peak[name] = max(peak[name], b["inflight"])
        codes = [f.result().status_code for f in futs]
    assert codes == [200] * 12
    assert max(peak.values()) <= 2
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    queued = next(ln for ln in metrics.splitlines() if ln.startswith("pulsegate_queued_total"))
    assert float(queued.split()[-1]) >= 1


def test_queue_timeout_is_503_with_retry_after(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """When capacity does not free up within routing.queue_timeout the answer is 503."""
    gw, _ = _fleet(start_sim, start_gateway, "100ms")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: _chat(gw, 40), range(6)))
    over = [r for r in results if r.status_code == 503]
    assert len(over) == 2 and sum(r.status_code == 200 for r in results) == 4
    assert over[0].json()["error"]["code"] == "overloaded"
    assert over[0].headers["retry-after"] == "1"


def test_min_ready_raises_an_event_and_a_metric(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Two ready backends against min_ready 3: a capacity event and the gauge at 1."""
    gw, _ = _fleet(start_sim, start_gateway, "1s")
    ev = wait_until(
        lambda: [e for e in gw.events() if e["to"] == "capacity_low"], timeout=5, what="event"
    )
    # Raised at the first count below 3: before the second backend was ready, on a slow box.
    assert re.fullmatch(
        r"only [012] ready backend\(s\) for demo-7b, min_ready is 3", ev[0]["reason"]
    )
    assert len(ev) == 1  # still below: not raised again
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert 'pulsegate_model_below_min_ready{model="demo-7b"} 1' in metrics
    assert 'pulsegate_model_ready{model="demo-7b"} 2' in metrics


def test_auto_limit_follows_the_engines_batch(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """`max_inflight: auto` learns the engine's batch capacity from its metrics: the gateway
    never sends more than that at once and queues the rest."""
    sim = start_sim("a", "--ttft-ms", "5", "--itl-ms", "20", "--max-batch", "3")
    gw = start_gateway(
        {
            "backends": [backend_entry(sim, max_inflight="auto", metrics_path="/metrics")],
            "probes": fast_probes(),
            "routing": {"queue_timeout": "10s"},
        }
    )
    gw.wait_all_ready()
    wait_until(lambda: gw.backends()["a"]["max_inflight"] == 3, timeout=10, what="limit learned")
    peak = 0
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        futs = [pool.submit(_chat, gw, 10) for _ in range(9)]
        while not all(f.done() for f in futs):
            peak = max(peak, gw.backends()["a"]["inflight"])
        codes = [f.result().status_code for f in futs]
    assert codes == [200] * 9
    assert 1 <= peak <= 3
