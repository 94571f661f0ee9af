"""`pulsegate epp --admin`: the picker's HTTP side (health, metrics, admin API, reload), and
several pickers sharing one truth through Redis (`cluster.redis`), as `serve`'s replicas do.

Real processes on loopback: `pulsegate epp` subprocesses, `pulsegate sim` engines, a real
`redis-server`. A pick is read where Envoy reads it: the picker's answer to an ext_proc
exchange (`epp.ask`). Waits poll with deadlines; nothing sleeps.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pulsegate.announce import host_port, read_until
from pulsegate.epp.ask import ask
from replicas.redis_server import REDIS, RedisServer, free_port
from support import Gateway, Sim, backend_entry, fast_probes, wait_until

ADMIN = re.compile(rb"admin listening on http://([\w.\-\[\]]+):(\d+)")
HEALTH: dict[str, Any] = {
    "evaluate_interval": "250ms",
    "ejection_base": "1s",
    "ejection_max": "2s",
    "rejoin_after": 1,
    "probation": {"duration": "1s"},
}


class Picker(Gateway):
    """`pulsegate epp --admin`: `url` is its admin HTTP side, `grpc_port` its ext_proc port."""

    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "epp") -> None:
        self.grpc_port = free_port()
        self.config_path = tmp / f"{name}.yaml"
        self.write_config(config)
        args = ["epp", "-c", str(self.config_path), "--listen", f"127.0.0.1:{self.grpc_port}"]
        super(Gateway, self).__init__([*args, "--admin"], tmp / f"{name}.log")

    def _read_address(self, timeout: float) -> tuple[str, int]:
        """The admin line, which follows the gRPC one (often in the same read)."""
        assert self.popen.stdout is not None
        m, buf = read_until(self.popen.stdout, ADMIN, timeout)
        if m:
            assert f"listening on 127.0.0.1:{self.grpc_port}".encode() in buf, buf
            return host_port(m)
        self.stop()
        raise RuntimeError(f"no admin line: {buf!r} {self.log_path.read_text()[-3000:]}")

    def pick(self, session: str | None = None) -> str:
        """The first endpoint of the picker's answer for a chat request."""
        got = ask(f"127.0.0.1:{self.grpc_port}", "demo-7b", session=session)
        assert got.status is None and got.endpoints, got
        return got.endpoints[0]


def _config(sims: list[Sim], **extra: Any) -> dict[str, Any]:
    return {
        "backends": [backend_entry(s) for s in sims],
        "probes": fast_probes(),
        "health": HEALTH,
        **extra,
    }


def test_the_admin_side_serves_health_metrics_backends_and_reload(tmp_path: Path) -> None:
    """/healthz, /metrics and /admin/backends answer; a reload adds a backend that the picker
    then picks; a broken file (SIGHUP) keeps the running config and says why; an operator's
    drain takes the backend out of the pick."""
    sims = [Sim(tmp_path, f"s{i}") for i in range(3)]
    epp = None
    try:
        epp = Picker(tmp_path, _config(sims[:2]))
        assert httpx.get(f"{epp.url}/healthz", timeout=5).status_code == 200
        epp.wait_all_ready()
        assert set(epp.backends()) == {"s0", "s1"}
        metrics = httpx.get(f"{epp.url}/metrics", timeout=5).text
        assert 'pulsegate_backend_state{backend="s0"' in metrics
        epp.write_config(_config(sims))
        r = epp.reload()
        assert r.status_code == 200 and r.json()["added"] == ["s2"], r.text
        epp.wait_state("s2", "ready", "probation", timeout=15)
        s2 = f"{sims[2].host}:{sims[2].port}"
        wait_until(lambda: any(epp.pick() == s2 for _ in range(30)), timeout=15, what="s2 picked")
        # A broken file: refused by SIGHUP, the three backends stay, the picker lives.
        epp.config_path.write_text("backends: [{name: x}]\n")
        epp.signal(signal.SIGHUP)
        wait_until(
            lambda: any(e.get("to") == "refused" for e in epp.events()), timeout=10, what="refused"
        )
        assert epp.alive() and set(epp.backends()) == {"s0", "s1", "s2"}
        # Drained: never picked again.
        assert httpx.post(f"{epp.url}/admin/backends/s0/drain", timeout=5).status_code == 200
        s0 = f"{sims[0].host}:{sims[0].port}"
        assert all(epp.pick(session=f"k{i}") != s0 for i in range(40))
    finally:
        if epp is not None:
            epp.stop()
        for s in sims:
            s.stop()


@pytest.fixture
def two_pickers(tmp_path: Path) -> Iterator[tuple[RedisServer, list[Sim], list[Picker]]]:
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    redis = RedisServer(free_port(), tmp_path / "redis.log")
    redis.start()
    sims: list[Sim] = []
    pickers: list[Picker] = []
    try:
        sims = [Sim(tmp_path, f"s{i}") for i in range(3)]
        for i in range(2):
            cluster = {"redis": redis.url, "replica_id": f"p{i}"}
            pickers.append(Picker(tmp_path, _config(sims, cluster=cluster), name=f"p{i}"))
        yield redis, sims, pickers
    finally:
        for p in pickers:
            p.stop()
        for s in sims:
            s.stop()
        redis.stop()


def _cluster(p: Picker) -> dict[str, Any]:
    return httpx.get(f"{p.url}/admin/cluster", timeout=5).json()  # type: ignore[no-any-return]


def _probe_rate(sims: list[Sim], window: float) -> float:
    before = sum(float(s.stats()["probe_requests_total"]) for s in sims)
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= window, timeout=window + 5, interval=0.2)
    after = sum(float(s.stats()["probe_requests_total"]) for s in sims)
    return (after - before) / (time.monotonic() - t0)


def test_two_pickers_share_probes_verdicts_and_sessions(
    two_pickers: tuple[RedisServer, list[Sim], list[Picker]],
) -> None:
    """Two pickers on one Redis: one owner per backend, the same on both; a backend failing
    every inference is out of both picks (only its owner probes it); a session gets the same
    first endpoint from either; probe load is that of one picker (one stopped: the other
    owns everything, and the rate barely moves)."""
    _, sims, pickers = two_pickers

    def together() -> bool:
        docs = [_cluster(p) for p in pickers]
        return all(not d["alone"] and len(d["replicas"]) == 2 for d in docs)

    wait_until(together, timeout=15, what="2 pickers together")
    for p in pickers:
        p.wait_all_ready()
    # Each recomputes the owners at its next lease renewal (every 0.5 s) once it sees both.
    owners = wait_until(
        lambda: (o := [_cluster(p)["probes"] for p in pickers])[0] == o[1] and o,
        timeout=5,
        what="the same owners on both",
    )
    assert set(owners[0]) == {"s0", "s1", "s2"}
    assert set(owners[0].values()) == {"p0", "p1"}, owners  # 3 backends over 2: both probe
    homes = [{p.pick(session=f"user-{i}") for p in pickers} for i in range(20)]
    assert sum(len(h) == 1 for h in homes) >= 19, homes
    sims[1].fault("error", rate=1.0)
    try:
        for p in pickers:
            p.wait_state("s1", "ejected", timeout=10)
        s1 = f"{sims[1].host}:{sims[1].port}"
        assert all(p.pick(session=f"k{i}") != s1 for p in pickers for i in range(20))
    finally:
        sims[1].fault("none")
    for p in pickers:
        try:
            p.wait_state("s1", "ready", "degraded", timeout=40)  # back in rotation
        except AssertionError as e:
            raise AssertionError(f"{e}: {p.backends()['s1']} {p.events()[-8:]}") from None
    seen: list[dict[str, tuple[str, str]]] = []

    def stable() -> bool:
        seen[:] = [
            {n: (b["state"], b["cadence"]) for n, b in p.backends().items()} for p in pickers
        ]
        return all(c[1] == "stable" for d in seen for c in d.values())

    try:
        wait_until(stable, timeout=40, what="stable cadence")
    except AssertionError as e:
        raise AssertionError(f"{e}: {seen}") from None
    both = _probe_rate(sims, 4.0)
    pickers[1].stop()
    wait_until(lambda: len(_cluster(pickers[0])["replicas"]) == 1, timeout=5, what="p1 gone")
    one = _probe_rate(sims, 4.0)
    assert one > 0 and both <= 1.3 * one, (both, one)
