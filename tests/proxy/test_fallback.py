"""Request-level fallback (R15): a bad backend costs a retry, never a client error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

# Slow active probes: these tests exercise the passive path (real traffic) on its own.
SLOW_PROBES = {
    "readiness": {"interval": "20s", "interval_unstable": "20s"},
    "micro_inference": {"interval": "20s", "jitter": "0s"},
    "canary": {"interval": "20s"},
}
RETRY = {"per_try_timeout": "500ms", "per_token_timeout": "20ms"}


@pytest.fixture
def fleet(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> dict[str, Any]:
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "1") for n in ("a", "b", "c")}
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims.values()],
            "probes": SLOW_PROBES,
            "retry": RETRY,
        }
    )
    gw.wait_all_ready()
    return {"sims": sims, "gw": gw}


def _run(gw: Gateway, n: int, session: str | None = None) -> list[tuple[str, int]]:
    """n chat requests with the openai client; returns (backend, attempts) of each."""
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=10)
    headers = {"x-session-id": session} if session else None
    out = []
    for i in range(n):
        raw = c.chat.completions.with_raw_response.create(
            model="demo-7b",
            messages=[{"role": "user", "content": f"hi {i}"}],
            max_tokens=4,
            extra_headers=headers,
        )
        assert raw.parse().choices[0].message.content
        out.append((raw.headers["x-pulsegate-backend"], int(raw.headers["x-pulsegate-attempts"])))
    return out


@pytest.mark.parametrize(
    ("fault", "params"), [("error", {"rate": 1.0}), ("hang", {}), ("kill", {})]
)
def test_failing_backend_is_routed_around(
    fleet: dict[str, Any], fault: str, params: dict[str, Any]
) -> None:
    """One backend answering 500 / hanging / refusing: every request still succeeds."""
    gw, bad = fleet["gw"], fleet["sims"]["c"]
    # A session whose home (affinity) is c, so the bad backend is surely tried first.
    home_c = next(key for key in (f"s{i}" for i in range(500)) if _run(gw, 1, key)[0][0] == "c")
    if fault == "kill":
        bad.kill()
    else:
        bad.fault(fault, **params)
    first = _run(gw, 1, home_c)
    assert first[0][1] == 2 and first[0][0] != "c"
    results = first + _run(gw, 20, home_c) + _run(gw, 40)
    assert all(backend != "c" for backend, _ in results)
    assert all(attempts <= 2 for _, attempts in results)
    # Consecutive failures on real traffic eject it within a handful of requests.
    assert sum(1 for _, attempts in results if attempts > 1) <= 8
    # Out of rotation (ejected), or down-weighted so far that it no longer gets first tries.
    c = gw.backends()["c"]
    assert c["state"] == "ejected" or (c["state"] == "degraded" and c["weight"] < 0.1), c


def test_never_the_same_backend_twice(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """With every backend failing, each request tries each backend once, then gets a 502."""
    sims = [start_sim(n) for n in ("a", "b")]
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims],
            "probes": SLOW_PROBES,
            "retry": {**RETRY, "max_attempts": 3},
        }
    )
    gw.wait_all_ready()
    for s in sims:
        s.fault("error", rate=1.0)
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}]}
    for _ in range(3):  # fewer than health.consecutive_failures: nobody is ejected yet
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 502
        assert r.headers["x-pulsegate-attempts"] == "2"
        assert r.json()["error"]["code"] == "upstream_failed"
    assert [s.stats()["client_requests_total"] for s in sims] == [3, 3]


def test_ejected_backend_gets_no_client_traffic(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """After ejection, the backend sees no client requests (probes only)."""
    sims = [start_sim(n, "--ttft-ms", "5", "--itl-ms", "1") for n in ("a", "b", "c")]
    gw = start_gateway(
        {"backends": [backend_entry(s) for s in sims], "probes": fast_probes(), "retry": RETRY}
    )
    gw.wait_all_ready()
    bad = sims[2]
    bad.fault("error", rate=1.0)
    wait_until(
        lambda: _run(gw, 5) and gw.backends()["c"]["state"] == "ejected",
        timeout=10,
        what="c ejected",
    )
    before = bad.stats()["client_requests_total"]
    _run(gw, 40)
    assert bad.stats()["client_requests_total"] == before
    events = [e for e in gw.events() if e["backend"] == "c" and e["to"] == "ejected"]
    assert events and events[-1]["reason"]


def test_ejection_cuts_attempts_waiting_for_a_first_byte(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """A request hung on a backend moves on as soon as that backend is ejected, long before
    its per-try timeout."""
    import concurrent.futures

    sims = [start_sim(n) for n in ("a", "b")]
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims],
            "probes": SLOW_PROBES,
            "retry": {"per_try_timeout": "30s", "per_token_timeout": "0s"},
        }
    )
    gw.wait_all_ready()
    home_b = next(k for k in (f"s{i}" for i in range(500)) if _run(gw, 1, k)[0][0] == "b")
    sims[1].fault("hang")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_run, gw, 1, home_b)
        wait_until(lambda: gw.backends()["b"]["inflight"] == 1, timeout=10, what="hung on b")
        httpx.post(f"{gw.url}/admin/backends/b/eject", timeout=5).raise_for_status()
        ((backend, attempts),) = fut.result(timeout=10)  # far below the 30 s per-try timeout
    assert (backend, attempts) == ("a", 2)
