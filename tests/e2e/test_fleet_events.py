"""Fleet events (issue #21, item 6): several backends at once, real processes on loopback.

Each test runs one event of `chaos/fleet.py` (the same code as `bench/fleet_events.py` and
`chaos.run --fleet`) with its holds halved and a 4 s probation, and asserts the event's
outcome claims (`fleet.checks`, timing claims left to the bench): a whole zone lost spills
with no client error and comes back; a rolling restart by `scripts/rolling_restart.py` loses
nothing; two of three lost under load sheds with 503 + Retry-After, cuts no stream, and lets
no client wait past `routing.queue_timeout` + 3 s. The figures live in docs/chaos.md.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from chaos import fleet  # noqa: E402
from support import Gateway, Sim, backend_entry, wait_until  # noqa: E402

pytestmark = pytest.mark.slow


def _run(key: str, tmp: Path, **kw: Any) -> dict[str, Any]:
    s = fleet.Settings(quick=True, logdir=tmp, probation_s=4.0, **kw)
    return asyncio.run(fleet.RUNNERS[key](s))


def _outcomes(key: str, r: dict[str, Any]) -> list[str]:
    """The outcome claims of `key` that did not hold."""
    return [claim for claim, ok, timing in fleet.checks(key, r) if not ok and not timing]


def test_a_whole_zone_lost_spills_to_the_other_with_no_error_and_comes_back(
    tmp_path: Path,
) -> None:
    """Both zone-a backends SIGKILLed at once under mixed load: 0 errors, 0 cut streams,
    what was sent meanwhile served by zone b, zone a serving again after its restart."""
    r = _run("zone_loss", tmp_path, rate=30.0)
    assert not _outcomes("zone_loss", r), (r["error_kinds"], r)
    assert r["sent_while_lost"] > 0


def test_a_rolling_restart_of_every_backend_loses_nothing(tmp_path: Path) -> None:
    """Drain, in-flight 0, restart, warm, undrain, ready, for each of 3 backends under load:
    0 errors, 0 cut streams, no stream needed a resume."""
    r = _run("rolling_restart", tmp_path, rate=30.0)
    assert not _outcomes("rolling_restart", r), (r["error_kinds"], r)
    assert [s["backend"] for s in r["steps"]] == ["r0", "r1", "r2"]


def test_two_of_three_lost_sheds_fast_503s_and_cuts_no_stream(tmp_path: Path) -> None:
    """Two of three small-batch backends SIGKILLed under twice what one serves: every error
    a 503 with Retry-After, no stream cut, nothing that was in flight lost (its retry or
    continuation waits at the queue's head), no client past queue_timeout + 3 s."""
    r = _run("two_lost", tmp_path)
    assert not _outcomes("two_lost", r), r
    assert r["shed_503"] > 0, "the load was meant to exceed what one backend serves"
    assert r["longest_wait_ms"] <= (2.0 + 3.0) * 1000, r["longest_wait_ms"]


def test_undrain_of_a_restarted_engine_still_warming_sends_it_nothing(
    tmp_path: Path, start_sim: Any, start_gateway: Any
) -> None:
    """An operator who undrains before the restarted engine is warm: the gateway probes it,
    holds it out (`warming`) and no client request reaches it before its `ready` event."""
    a, b = start_sim("a"), start_sim("b")
    health = {"probation": {"duration": "4s"}}
    gw: Gateway = start_gateway(
        {"backends": [backend_entry(a), backend_entry(b)], "health": health}
    )
    gw.wait_all_ready(20)
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    httpx.post(f"{gw.url}/admin/backends/a/drain", timeout=5).raise_for_status()
    wait_until(lambda: gw.backends()["a"]["inflight"] == 0, 10, what="a idle")
    port = a.port
    a.stop()
    a = Sim(tmp_path, "a", port=port)
    try:
        a.fault("warming", seconds=2)
        t_undrain = time.time()
        httpx.post(f"{gw.url}/admin/backends/a/undrain", timeout=5).raise_for_status()
        with httpx.Client(timeout=10) as c:

            def served_by_a() -> bool:
                r = c.post(f"{gw.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.headers["x-pulsegate-backend"] == "a"

            wait_until(served_by_a, 20, interval=0.05, what="a serving again")
        moves = [(e["to"], e["ts"]) for e in gw.events() if e.get("backend") == "a"]
        after = [(to, ts) for to, ts in moves if ts >= t_undrain - 0.05]
        assert "warming" in [to for to, _ in after], moves
        ready_at = min(ts for to, ts in after if to == "ready")
        r = httpx.get(f"{a.url}/sim/requests", params={"since": t_undrain}, timeout=5)
        arrivals = [x["t"] for x in r.json()["requests"]]
        assert arrivals and min(arrivals) >= ready_at - 0.02, (arrivals[:3], ready_at)
    finally:
        a.stop()


def test_the_operator_script_refuses_to_drain_the_last_backend_of_a_model() -> None:
    """`scripts/rolling_restart.py` will not drain a backend whose models no other backend
    in rotation serves (that would be an outage, not a restart)."""
    roll = fleet.operator_script()
    up = {"state": "ready", "models": ["m"]}
    assert roll.others_in_rotation({"a": up, "b": up}, "a") == []
    assert roll.others_in_rotation({"a": up, "b": {**up, "state": "ejected"}}, "a") == ["m"]
    assert roll.others_in_rotation({"a": up, "b": {"state": "ready", "models": []}}, "a") == []
