"""The upstream client's stale-connection retry, end to end through a gateway process."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from script_engines import STALE, ScriptEngine

from support import Gateway, fast_probes


def test_gateway_retries_stale_connections_invisibly(
    start_engine: Callable[..., ScriptEngine], start_gateway: Callable[..., Gateway]
) -> None:
    """An engine that resets every reused connection still answers every request on the
    first attempt: the gateway's pool resends on a fresh connection, and the backend
    stays ready (a stale connection is not the engine's failure)."""
    engine = start_engine(STALE)
    gw = start_gateway(
        {
            "backends": [{"name": "e", "url": engine.url, "models": ["demo-7b"]}],
            "probes": fast_probes(),
        }
    )
    gw.wait_all_ready()
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for _ in range(6):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["x-pulsegate-attempts"] == "1"
    seen = httpx.get(f"{engine.url}/stats", timeout=5).json()
    assert seen["answered"] == 6
    assert seen["dropped"] >= 5  # every request after the first met a reused connection
    assert gw.backends()["e"]["state"] == "ready"
