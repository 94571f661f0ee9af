"""Routing end to end (R24, R25, R28, R29): real simulated engines, a real gateway.

Session affinity, zone preference and spill, warm-up and the per-backend concurrency limit,
each checked where it can be seen from outside: the `x-pulsegate-backend` header of every
answer, each sim's own count of the client requests that reached it (`/sim/stats`), and the
gateway's `/admin/backends` and `/admin/events`. Nothing sleeps to let things settle; waits
poll with functional deadlines. `bench/routing.py` measures the figures (home share, TTFT with
and without affinity, cross-zone share, rejection rate).
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from pulsegate.balancer import Balancer
from pulsegate.config import RoutingConfig
from pulsegate.health.verdict import State, Verdict
from support import Gateway, Sim, backend_entry, fast_probes, wait_until

FAST_SIM = ("--ttft-ms", "5", "--itl-ms", "1")
# ~100 ms probe latencies: scheduler jitter on a busy host stays far from the 1.7x own-baseline
# slowdown that drops a backend's weight into a lower rendezvous octave, which moves part of
# its sessions by design (docs/routing.md).
STEADY_SIM = ("--ttft-ms", "100", "--itl-ms", "1")
RETRY = {"per_try_timeout": "500ms", "per_token_timeout": "20ms"}
# Active probes that stay out of the way once the fleet is ready: the sims' in-flight counts
# are then client requests only, and ejection comes from real traffic.
SLOW_PROBES = {
    "readiness": {"interval": "20s", "interval_unstable": "20s"},
    "micro_inference": {"interval": "20s", "jitter": "0s"},
    "canary": {"interval": "20s"},
}
SESSIONS = [f"session-{i}" for i in range(30)]


def _chat(
    client: httpx.Client, gw: Gateway, session: str | None = None, tokens: int = 4, **extra: Any
) -> httpx.Response:
    """One chat request; `session` goes in `x-session-id`."""
    headers = {"x-session-id": session} if session else {}
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": tokens,
        **extra,
    }
    return client.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=15)


def _served_by(client: httpx.Client, gw: Gateway, session: str | None = None, **kw: Any) -> str:
    """The backend that answered one request, which must succeed."""
    r = _chat(client, gw, session, **kw)
    assert r.status_code == 200, r.text
    return r.headers["x-pulsegate-backend"]


def _one(gw: Gateway, tokens: int, session: str | None = None) -> httpx.Response:
    """One request on its own connection (for thread pools)."""
    with httpx.Client() as c:
        return _chat(c, gw, session, tokens=tokens)


def _homes(names: Iterable[str], keys: Iterable[str]) -> dict[str, str]:
    """Each session key's home when all `names` are ready, by the balancer's own hash."""
    balancer = Balancer(RoutingConfig(), random.Random(0))
    fleet = [Verdict(n, State.READY, 100.0, 1.0) for n in names]
    return {k: v.name for k in keys if (v := balancer.pick(fleet, {}, session_key=k))}


def _session_homed(names: str) -> dict[str, str]:
    """One session key per backend in `names`, homed there when all of them are ready."""
    homes = _homes(names, (f"probe-{i}" for i in range(200)))
    return {home: key for key, home in reversed(homes.items())}


def _route_all(gw: Gateway, keys: list[str]) -> dict[str, str]:
    """Where each session is served now, 6 requests at a time. Even-numbered keys go in
    `x-session-id`, odd ones in the OpenAI `user` field: both are session keys."""
    with (
        httpx.Client(limits=httpx.Limits(max_connections=6)) as c,
        concurrent.futures.ThreadPoolExecutor(6) as pool,
    ):

        def one(k: str) -> str:
            if int(k.rsplit("-", 1)[1]) % 2 == 0:
                return _served_by(c, gw, k)
            return _served_by(c, gw, user=k)

        return dict(zip(keys, pool.map(one, keys), strict=True))


def _weights(gw: Gateway) -> dict[str, float]:
    """Effective weights: a backend under 0.71 x a peer's is in a lower rendezvous octave."""
    return {n: b["weight"] for n, b in gw.backends().items()}


def _admin(gw: Gateway, name: str, action: str) -> None:
    httpx.post(f"{gw.url}/admin/backends/{name}/{action}", timeout=5).raise_for_status()


def _client_requests(sims: Iterable[Sim]) -> dict[str, int]:
    return {s.name: s.stats()["client_requests_total"] for s in sims}


def _capacity_events(gw: Gateway) -> list[str]:
    """The min_ready events so far, oldest first: "capacity_low" / "capacity_ok"."""
    return [e["to"] for e in gw.events() if e["to"] in ("capacity_low", "capacity_ok")]


def _parallel(n: int, workers: int, fn: Callable[[httpx.Client], httpx.Response]) -> list[Any]:
    """`n` calls of `fn` on `workers` threads, one httpx client per thread."""
    local = threading.local()
    clients: list[httpx.Client] = []

    def call(_: int) -> httpx.Response:
        if not hasattr(local, "c"):
            local.c = httpx.Client()
            clients.append(local.c)
        return fn(local.c)

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(call, range(n)))
    finally:
        for c in clients:
            c.close()


# ---------------------------------------------------------------------------------------------


def test_sessions_stay_home_and_only_the_lost_backends_sessions_move(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Each session sticks to one backend; draining or ejecting it moves only its sessions."""
    sims = [start_sim(n, *STEADY_SIM) for n in "abc"]
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims],
            "probes": fast_probes(),
            "retry": RETRY,
            # No bounded-load spill (requests go 6 at a time): this test is about the hash.
            "routing": {"affinity_epsilon": 100.0},
        }
    )
    gw.wait_all_ready()
    home = _route_all(gw, SESSIONS)
    assert set(home.values()) == {"a", "b", "c"}
    assert _route_all(gw, SESSIONS) == home, _weights(gw)
    assert _route_all(gw, SESSIONS) == home, _weights(gw)

    for action, victim in (("drain", home[SESSIONS[0]]), ("eject", home[SESSIONS[1]])):
        _admin(gw, victim, action)
        now = _route_all(gw, SESSIONS)
        moved = {k for k in SESSIONS if now[k] != home[k]}
        assert moved == {k for k in SESSIONS if home[k] == victim}, (action, moved, _weights(gw))
        assert victim not in now.values()
        # The moved sessions have a new, stable home; undrain lets the drained one return.
        assert _route_all(gw, SESSIONS) == now, _weights(gw)
        if action == "drain":
            _admin(gw, victim, "undrain")
            gw.wait_state(victim, "ready")
            assert _route_all(gw, SESSIONS) == home, _weights(gw)


def test_zone_is_preferred_then_region_then_anywhere_without_client_errors(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """No request crosses zones while the local zone is healthy; when it fails traffic goes
    to the same region, then to the other region, and every request succeeds."""
    sims = {n: start_sim(n, *FAST_SIM) for n in "abcd"}
    where = {"a": ("z1", "r1"), "b": ("z1", "r1"), "c": ("z2", "r1"), "d": ("z3", "r2")}
    gw = start_gateway(
        {
            "backends": [
                backend_entry(s, zone=where[n][0], region=where[n][1]) for n, s in sims.items()
            ],
            "probes": fast_probes(),
            "retry": RETRY,
            "routing": {"prefer_zone": "z1"},
        }
    )
    gw.wait_all_ready()

    failed: list[str] = []  # every non-200 answer, whatever phase (and inside wait_until)

    def burst(n: int, sessions: bool = True) -> set[str]:
        """`n` requests, 4 at a time: the "backend/attempts" of those that succeeded."""

        def one(c: httpx.Client) -> httpx.Response:
            return _chat(c, gw, random.choice(SESSIONS) if sessions else None)

        rs = _parallel(n, 4, one)
        failed.extend(f"{r.status_code} {r.text}" for r in rs if r.status_code != 200)
        return {
            f"{r.headers['x-pulsegate-backend']}/{r.headers['x-pulsegate-attempts']}"
            for r in rs
            if r.status_code == 200
        }

    assert burst(40) == {"a/1", "b/1"}
    assert burst(40, sessions=False) == {"a/1", "b/1"}
    assert _client_requests([sims["c"], sims["d"]]) == {"c": 0, "d": 0}

    # The whole local zone fails: its requests are retried (not failed) until both are ejected.
    sims["a"].fault("error", rate=1.0)
    sims["b"].fault("error", rate=1.0)
    wait_until(
        lambda: burst(8) and {gw.backends()[n]["state"] for n in "ab"} == {"ejected"},
        timeout=15,
        what="a and b ejected",
    )
    assert burst(40) == {"c/1"}  # routed there at once, not after a failed try
    assert _client_requests([sims["d"]]) == {"d": 0}

    # Then the same region goes too (drained): the other region takes over.
    _admin(gw, "c", "drain")
    assert burst(40) == {"d/1"}
    assert burst(20, sessions=False) == {"d/1"}
    assert not failed, failed


def test_panic_never_starves_a_healthy_remote_backend_for_ejected_local_ones(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """With the local zone ejected and the fleet in panic, the healthy remote backend serves."""
    sims = {n: start_sim(n, *FAST_SIM) for n in "abd"}
    zone = {"a": "z1", "b": "z1", "d": "z3"}
    gw = start_gateway(
        {
            "backends": [backend_entry(s, zone=zone[n]) for n, s in sims.items()],
            "probes": fast_probes(),
            "retry": RETRY,
            "routing": {"prefer_zone": "z1"},
        }
    )
    gw.wait_all_ready()
    _admin(gw, "a", "eject")
    _admin(gw, "b", "eject")  # 2 of 3 ejected: over max_ejected_fraction, so panic
    assert httpx.get(f"{gw.url}/admin/backends", timeout=5).json()["panic"] is True
    with httpx.Client() as c:
        served = [_served_by(c, gw) for _ in range(30)]
    assert "d" in served, served


def test_warming_backend_gets_no_client_traffic_and_min_ready_alerts(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Sessions homed on a warming backend are served elsewhere and it sees no client request;
    min_ready reports the shortfall; once ready, those sessions move to it."""
    sims = {n: start_sim(n, *FAST_SIM) for n in "ab"}
    sims["b"].fault("warming", seconds=600.0)  # lifted by hand below
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims.values()],
            "probes": fast_probes(),
            "retry": RETRY,
            "routing": {"min_ready": 2},
        }
    )
    gw.wait_state("a", "ready")
    gw.wait_state("b", "warming")
    home = _homes("ab", SESSIONS)  # where each session lives once both are ready
    assert "b" in home.values()

    with httpx.Client() as c:
        assert {_served_by(c, gw, k) for k in SESSIONS for _ in range(2)} == {"a"}
        assert {_served_by(c, gw) for _ in range(20)} == {"a"}
        assert gw.backends()["b"]["state"] == "warming"
        assert sims["b"].stats()["client_requests_total"] == 0
        assert _capacity_events(gw)[-1] == "capacity_low"
        metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
        assert 'pulsegate_model_below_min_ready{model="demo-7b"} 1' in metrics
        assert 'pulsegate_model_ready{model="demo-7b"} 1' in metrics

        sims["b"].fault("none")
        gw.wait_state("b", "ready")
        wait_until(lambda: _capacity_events(gw)[-1] == "capacity_ok", timeout=5, what="ok")
        # Within a moment of b being ready (its weight settles with its first evaluations),
        # every session is at its home, b's included.
        wait_until(
            lambda: {k: _served_by(c, gw, k) for k in SESSIONS} == home,
            timeout=10,
            what="sessions at home",
        )


def test_max_inflight_holds_under_a_burst_with_one_backend_failed(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """40 concurrent requests on three backends limited to 3 each, one answering 500: no
    backend ever has more than 3 in flight, and the survivors serve at their limit."""
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "20") for n in "abc"}
    gw = start_gateway(
        {
            "backends": [backend_entry(s, max_inflight=3) for s in sims.values()],
            "probes": SLOW_PROBES,
            "retry": RETRY,
            "routing": {"queue_timeout": "10s"},
        }
    )
    gw.wait_all_ready()
    sims["c"].fault("error", rate=1.0)
    peak_gw = dict.fromkeys(sims, 0)
    peak_sim = dict.fromkeys(sims, 0)
    # One shared client (httpx is thread-safe) so the 40 requests really start together.
    with (
        httpx.Client(limits=httpx.Limits(max_connections=50)) as client,
        concurrent.futures.ThreadPoolExecutor(40) as pool,
    ):
        futs = [pool.submit(_chat, client, gw, None, 25) for _ in range(40)]
        while not all(f.done() for f in futs):
            for name, b in gw.backends().items():
                peak_gw[name] = max(peak_gw[name], b["inflight"])
            for name, s in sims.items():
                peak_sim[name] = max(peak_sim[name], s.stats()["inflight"])
        results = [f.result() for f in futs]
    assert max(peak_gw.values()) <= 3, peak_gw
    assert max(peak_sim.values()) <= 3, peak_sim  # slow probes: the sims see client requests only
    assert peak_gw["a"] == peak_gw["b"] == 3, peak_gw  # the limit was reached, and held
    served = [r.headers["x-pulsegate-backend"] for r in results if r.status_code == 200]
    assert set(served) == {"a", "b"} and len(served) >= 30, [r.status_code for r in results]
    # Queue timeouts are 503 `overloaded`; a 502 here is the retry-without-queue bug below.
    assert all(r.json()["error"]["code"] == "overloaded" for r in results if r.status_code == 503)


def test_a_retry_that_finds_the_survivors_full_waits_for_capacity(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """A request failed by one backend while the others are at their limit queues, not 502s."""
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "20") for n in "abc"}
    gw = start_gateway(
        {
            "backends": [backend_entry(s, max_inflight=1) for s in sims.values()],
            "probes": SLOW_PROBES,
            "retry": RETRY,
            "routing": {"queue_timeout": "10s"},
        }
    )
    gw.wait_all_ready()
    key = _session_homed("abc")
    sims["c"].fault("error", rate=1.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # One long request fills a, one fills b (each ~1 s: 50 tokens x 20 ms).
        busy = [pool.submit(_one, gw, 50, key[n]) for n in "ab"]
        wait_until(
            lambda: [b["inflight"] for b in gw.backends().values()] == [1, 1, 0],
            timeout=5,
            what="a and b full",
        )
        r = _one(gw, 4, key["c"])  # tries c first (its home): 500, then a and b are full
        assert [f.result().status_code for f in busy] == [200, 200]
    assert r.status_code == 200, r.text
    assert r.headers["x-pulsegate-attempts"] == "2"
