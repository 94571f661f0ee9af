"""A slow node is degraded (issue #21, item 4), end to end: three real sims behind a real
gateway under a light steady load; `POST /sim/fault {"mode": "slow", "factor": 5}` on one of
them must turn it `degraded` with cause `slow` (issue target: within 5 s), and lifting the
fault must bring it back to `ready`. The time is the gateway's own event time (`ts`, wall
clock) minus the moment the fault was posted; it is printed. The assertion's deadline is
functional (a loaded 2-core box), the figure is what the test reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

SIM = ("--ttft-ms", "40", "--itl-ms", "2")
HEALTH = {"evaluate_interval": "250ms", "ejection_base": "500ms", "rejoin_after": 3}
TARGET_S = 5.0  # issue #21: "5x slow node `degraded` within 5 s"
DEADLINE_S = 12.0  # what the test asserts on a loaded box; the figure is printed
RATE_HZ = 20.0  # the light steady load, requests per second


class Load:
    """A thread sending one small completion every 1/RATE_HZ s until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=20)
        assert not self._thread.is_alive()

    def _run(self) -> None:
        # Streamed, as chat clients do: the gateway measures time to first token on those.
        body = {"model": "demo-7b", "prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.Client(timeout=10) as c:
            while not self._stop.wait(1.0 / RATE_HZ):
                try:
                    with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        text = r.read()
                    ok = r.status_code == 200 and b"[DONE]" in text
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.ok += 1
                else:
                    self.failed += 1


@pytest.fixture
def fleet(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> tuple[Gateway, dict[str, Sim]]:
    sims = {n: start_sim(n, *SIM) for n in "abc"}
    config: dict[str, Any] = {
        "backends": [backend_entry(s) for s in sims.values()],
        "probes": fast_probes(),
        "health": HEALTH,
    }
    gw = start_gateway(config)
    gw.wait_all_ready()
    return gw, sims


def _degraded_after(gw: Gateway, name: str, t0: float) -> tuple[dict[str, Any], float]:
    def found() -> dict[str, Any] | None:
        for e in gw.events():
            if e["backend"] == name and e["to"] == "degraded" and e["ts"] >= t0:
                return dict(e)
        return None

    try:
        event: dict[str, Any] = wait_until(found, timeout=DEADLINE_S + 5, what=f"{name} degraded")
    except AssertionError:
        for n, b in gw.backends().items():  # what the rule saw, for the failure report
            print(n, b["state"], {k: b["signals"][k] for k in ("ttft_ms", "latency_ms")})
        raise
    return event, event["ts"] - t0


def test_5x_slow_node_is_degraded_with_cause_slow_and_ready_again(
    fleet: tuple[Gateway, dict[str, Sim]],
) -> None:
    gw, sims = fleet
    with Load(gw.url) as load:
        # Some traffic to every backend first, so each has a TTFT to compare.
        wait_until(lambda: load.ok >= 40, timeout=20, what="warm-up traffic")
        t0 = time.time()
        sims["a"].fault("slow", factor=5)
        event, took = _degraded_after(gw, "a", t0)
        print(f"\n5x slow -> degraded in {took:.2f} s (target {TARGET_S:g} s): {event['reason']}")
        assert event["cause"] == "slow", event
        assert "x its 2 peers' median" in event["reason"], event
        assert took <= DEADLINE_S, f"degraded {took:.2f}s after the fault"
        view = gw.backends()["a"]
        assert view["state"] == "degraded" and view["last_cause"] == "slow", view
        assert {gw.backends()[n]["state"] for n in "bc"} == {"ready"}
        # Lifted: back within 1.5x of its peers, and ready.
        t1 = time.time()
        sims["a"].fault("none")
        gw.wait_state("a", "ready", timeout=20)
        print(f"fault lifted -> ready in {time.time() - t1:.2f} s")
    assert load.failed == 0, f"{load.failed} requests failed"
    assert not [e for e in gw.events() if e["backend"] == "a" and e["to"] == "ejected"]
