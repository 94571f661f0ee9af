"""Client limits held across gateway replicas through a real Redis (`cluster.redis`).

Real processes on loopback: one `redis-server`, one simulated engine, three `pulsegate
serve` sharing the Redis; clients are httpx and the official `openai` SDK. Without the
shared reports each replica would admit its own full limit (3x for the fleet).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from replicas.redis_server import REDIS, RedisServer, free_port
from support import Gateway, Sim, backend_entry, fast_probes, wait_until

MODEL = "demo-7b"
PACED = "pg-fleet-paced-1b2c3d4e5f60"  # rpm 20
CONC = "pg-fleet-conc-9a8b7c6d5e4f"  # 2 at once
FREE = "pg-fleet-free-0a1b2c3d4e5f"  # no limits
ALONE = "pg-fleet-alone-5f4e3d2c1b0a"  # rpm 30, first used with Redis down
# What a gateway logs when its client limits go alone and come back (`front/fleet_sync.py`).
ALONE_LOG = "client limits: reports to the fleet stopped getting out"
REJOIN_LOG = "client limits: the fleet's reports flow again"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.redis = RedisServer(free_port(), tmp / "redis.log")
        self.redis.start()
        self.sim = Sim(tmp, "sim", "--itl-ms", "20")
        keys = {"keys": [
            {"name": "paced", "sha256": sha(PACED), "rpm": 20},
            {"name": "conc", "sha256": sha(CONC), "concurrency": 2},
            {"name": "free", "sha256": sha(FREE)},
            {"name": "alone", "sha256": sha(ALONE), "rpm": 30},
        ]}  # fmt: skip
        (tmp / "keys.yaml").write_text(yaml.safe_dump(keys))
        cfg: dict[str, Any] = {
            "backends": [backend_entry(self.sim)],
            "probes": fast_probes(),
            "auth": {"keys_file": "keys.yaml"},
            "cluster": {"redis": self.redis.url},
        }
        self.gws = [Gateway(tmp, cfg, name=f"gw{i}") for i in range(3)]

    def close(self) -> None:
        for gw in self.gws:
            gw.stop()
        self.sim.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        for gw in f.gws:
            gw.wait_all_ready()
        yield f
    finally:
        f.close()


def post(gw: Gateway, key: str, max_tokens: int = 2) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}  # fmt: skip
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=20,
                   headers={"authorization": f"Bearer {key}"})  # fmt: skip
    return r.status_code


def test_a_paced_client_over_three_replicas_gets_the_limit_once(fleet: Fleet) -> None:
    """rpm 20, 30 requests 0.1 s apart round robin over 3 replicas: the fleet admits the
    minute's 20 (and ~1 of refill), not 30 (each replica alone would see only 10)."""
    codes = []
    for i in range(30):
        t0 = time.monotonic()
        codes.append(post(fleet.gws[i % 3], PACED))
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))  # the client's pace, not a wait
    assert set(codes) <= {200, 429}
    assert 20 <= codes.count(200) <= 22, codes


def test_requests_in_flight_count_on_every_replica(fleet: Fleet) -> None:
    """concurrency 2: two streams open through gw0 make gw1 answer 429; once they end,
    gw1 admits again."""
    c0 = openai.OpenAI(base_url=f"{fleet.gws[0].url}/v1", api_key=CONC, max_retries=0)
    msgs: Any = [{"role": "user", "content": "x"}]
    streams = [
        c0.chat.completions.create(model=MODEL, messages=msgs, max_tokens=400, stream=True)
        for _ in range(2)
    ]
    first = [next(iter(s)) for s in streams]  # both have started: both are in flight
    assert all(f is not None for f in first)
    try:
        wait_until(lambda: post(fleet.gws[1], CONC) == 429, timeout=5,
                   what="gw1 refuses a third request of the key")  # fmt: skip
    finally:
        for s in streams:
            s.close()
    wait_until(lambda: post(fleet.gws[1], CONC) == 200, timeout=10,
               what="gw1 admits once the streams ended")  # fmt: skip


def test_a_dead_redis_fails_no_request_and_limits_still_hold(fleet: Fleet) -> None:
    """Redis SIGKILLed: every request still answered (no 5xx from the door); once alone,
    each replica keeps a third of rpm 30, so the fleet still admits ~30, not 90. Redis back:
    the replicas rejoin and requests keep flowing."""
    fleet.redis.kill()
    try:
        codes = []
        for gw in fleet.gws:

            def alone(gw: Gateway = gw) -> bool:
                codes.append(post(gw, FREE))  # requests keep coming meanwhile
                return ALONE_LOG in gw.log_path.read_text()

            wait_until(alone, timeout=10, what="a replica works alone")
        assert codes and set(codes) == {200}
        seen = []
        for gw in fleet.gws:
            for _ in range(40):
                seen.append(post(gw, ALONE))
                if seen[-1] == 429:
                    break
        assert set(seen) == {200, 429}, seen
        assert 28 <= seen.count(200) <= 33, seen
    finally:
        fleet.redis.start()
    for gw in fleet.gws:
        wait_until(lambda gw=gw: REJOIN_LOG in gw.log_path.read_text(), timeout=10,
                   what="a replica rejoins")  # fmt: skip
    codes = [post(gw, FREE) for gw in fleet.gws for _ in range(5)]
    assert set(codes) == {200}
