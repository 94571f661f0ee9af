"""Issue 17 in the chaos lab: Redis cut off by iptables in a namespace under 3 replicas.

The partition is the one Redis fault only the lab can make (SIGKILL and SIGSTOP are in
tests/e2e/test_replicas.py): `chaos.replicas.run_all`, the same code as
`make chaos CHAOS_ARGS=--replicas`, with a short hold. Generous bounds only; the figures
live in docs/chaos.md.
"""

from __future__ import annotations

import shutil

import pytest
from chaos.lab import Lab

from chaos import replicas

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]


async def test_redis_cut_off_leaves_replicas_alone_without_errors_or_flaps(lab: Lab) -> None:
    """Every packet to Redis dropped: each replica alone within 2.5 s, no client error, all
    three together again after the lift, and no backend out of rotation on any replica."""
    s = replicas.Settings(rate=20.0, pre=0.5, hold=2.0, post=0.2)
    [r] = await replicas.run_all(lab, ["redis_partition"], s)
    assert r["ok"], r.get("error")
    assert r["client_errors"] == 0, r["error_kinds"]
    assert r["requests_since_fault"] > 30
    assert r["time_to_alone_max_s"] is not None and r["time_to_alone_max_s"] < 2.5, r
    assert r["together_after_lift_max_s"] is not None, r["together_after_lift_per_replica_s"]
    assert r["flaps"] == [], r["flaps"]
