"""Reload in place and replacement: the gateway changes its config, or its process, under
streaming load, and no request fails and no stream is cut (real sims, a real gateway)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import Gateway, Proc, Sim, backend_entry, fast_probes, sse_events, wait_until

TOKENS = 24  # a stream of ~0.25 s on the sim (10 ms a token)


class Load:
    """Clients sending requests back to back (every other one streamed), each on its own
    keep-alive connection pool; every failure and every stream without [DONE] is kept."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url = url
        self.ok = 0
        self.streams = 0
        self.retried: list[str] = []  # a reused connection closed before any byte came back
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=20) as client:
            while not self._stop.is_set() and n < 100_000:
                n += 1
                stream = (n + i) % 2 == 0
                body = {
                    "model": "demo-7b",
                    "messages": [{"role": "user", "content": f"hello {i} {n}"}],
                    "max_tokens": TOKENS,
                    "stream": stream,
                }
                try:
                    self._one(client, body, stream)
                except httpx.RemoteProtocolError as e:
                    # HTTP/1.1's keep-alive race (RFC 9112 9.3.1): the server closed a
                    # connection the client was sending on, nothing of an answer came back;
                    # clients retry it on a new connection (the openai SDK does by itself).
                    self.retried.append(f"{e} ({'stream' if stream else 'plain'})")
                    try:
                        self._one(client, body, stream)
                    except httpx.HTTPError as e2:
                        self.failures.append(f"{type(e2).__name__} on the retry: {e2}")
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")

    def _one(self, client: httpx.Client, body: dict[str, Any], stream: bool) -> None:
        url = f"{self.url}/v1/chat/completions"
        if not stream:
            r = client.post(url, json=body)
            if r.status_code != 200:
                self.failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
            else:
                self.ok += 1
            return
        with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                self.failures.append(f"stream HTTP {r.status_code}")
                return
            events = list(sse_events(r))
        if not events or events[-1] != b"data: [DONE]" or any(b'"error"' in e for e in events):
            self.failures.append(f"stream cut: {events[-2:]!r}")
        else:
            self.ok += 1
            self.streams += 1


def _config(sims: list[Sim], **extra: Any) -> dict[str, Any]:
    return {"backends": [backend_entry(s) for s in sims], "probes": fast_probes(), **extra}


def _served(sim: Sim) -> int:
    return int(sim.stats()["client_requests_total"])


def test_reload_adds_removes_changes_and_refuses_under_streaming_load(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Add serves within 2 s, remove gets nothing new after 1 s, change keeps health,
    an invalid file changes nothing; 0 failed requests, 0 cut streams."""
    a, b, c = start_sim("a"), start_sim("b"), start_sim("c")
    gw = start_gateway(_config([a, b]))
    gw.wait_all_ready()
    with Load(gw.url) as load:
        wait_until(lambda: load.ok >= 10, what="load running")
        # Add c: probed at once, serving within 2 s.
        gw.write_config(_config([a, b, c]))
        r = gw.reload()
        assert r.status_code == 200 and r.json()["added"] == ["c"], r.text
        t0 = time.monotonic()
        wait_until(lambda: _served(c) > 0, timeout=2.0, what="c serving")
        assert time.monotonic() - t0 < 2.0
        # Remove a: nothing new after 1 s (its in-flight requests finish).
        gw.write_config(_config([b, c]))
        assert gw.reload().json()["removed"] == ["a"]
        # Its requests in flight at the reload finish (within 1 s at this load) ...
        wait_until(lambda: a.stats()["inflight"] == 0, timeout=1.0, what="a drained")
        before = _served(a)
        done = load.ok
        wait_until(lambda: load.ok >= done + 30, what="more load")
        assert _served(a) == before  # ... and none arrive after
        assert "a" not in gw.backends()
        # Change b's weight: its health is kept (still ready, never cold again).
        since = gw.backends()["b"]["since"]
        gw.write_config(
            {**_config([c]), "backends": [backend_entry(b, weight=2.0), backend_entry(c)]}
        )
        out = gw.reload().json()
        assert out["ok"] and not out["added"] and not out["restarted"]
        view = gw.backends()["b"]
        assert view["state"] == "ready" and view["since"] == since
        # An invalid file: 400 naming the key, the running config stays.
        gw.config_path.write_text("backends:\n  - name: x\n    url: ftp://nope\n")
        bad = gw.reload()
        assert bad.status_code == 400
        assert any("backends[0].url" in e for e in bad.json()["errors"]), bad.text
        assert set(gw.backends()) == {"b", "c"}
        wait_until(lambda: load.ok >= 60, what="load after the refused reload")
    assert load.failures == [] and load.retried == []  # a reload never closes a connection
    assert load.streams > 10
    reloads = [e for e in gw.events() if e["backend"] == "config"]
    assert [e["to"] for e in reloads] == ["reloaded", "reloaded", "reloaded", "refused"]
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'pulsegate_config_reloads_total{result="ok"} 3' in metrics
    assert 'pulsegate_config_reloads_total{result="refused"} 1' in metrics


def test_a_url_change_restarts_health_and_other_keys_apply(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Same name, new URL: judged again from cold; retry/routing keys apply; the listen
    address keeps its running value and the answer says it needs a replacement."""
    a, b, a2 = start_sim("a"), start_sim("b"), start_sim("a2")
    gw = start_gateway(_config([a, b]))
    gw.wait_all_ready()
    moved = {**backend_entry(a2), "name": "a"}
    gw.write_config(
        {
            **_config([b]),
            "backends": [moved, backend_entry(b)],
            "gateway": {"listen": "127.0.0.1:1"},
            "retry": {"max_attempts": 2},
        }
    )
    out = gw.reload().json()
    assert out["restarted"] == ["a"] and out["needs_replace"] == ["gateway.listen"]
    gw.wait_state("a", "ready")
    assert gw.backends()["a"]["url"] == a2.url
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    # One request at a time goes to the backend with the clearly lower RTT (`balancer._p2c`):
    # the new URL's comes from probes alone at first, and on a loaded box it can stay above
    # b's for the first 20 requests (seen once in a fresh-clone run). Every answer is a 200
    # meanwhile; the new URL serves within the deadline.
    deadline = time.monotonic() + 20
    sent = 0
    while _served(a2) == 0:
        assert time.monotonic() < deadline, f"a's new URL served none of {sent} requests"
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=body).status_code == 200
        sent += 1
    print(f"a's new URL served its first request after {sent}")


def test_sighup_storm_no_crash_last_file_wins(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Ten SIGHUPs in a second, the file changing between them: alive, last one wins."""
    sims = [start_sim(n) for n in ("a", "b", "c")]
    gw = start_gateway(_config(sims[:1]))
    gw.wait_all_ready()
    for i in range(10):
        gw.write_config(_config(sims[: 1 + (i % 3)]))
        gw.signal(signal.SIGHUP)
        time.sleep(0.1)
    final = _config(sims[:2])
    gw.write_config(final)
    gw.signal(signal.SIGHUP)
    wait_until(lambda: set(gw.backends()) == {"a", "b"}, what="the last file in force")
    assert gw.alive()
    assert httpx.get(f"{gw.url}/healthz").status_code == 200
    n = sum(1 for e in gw.events() if e["backend"] == "config" and e["to"] == "reloaded")
    assert 1 <= n <= 11


def test_reload_reaches_every_worker(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """gateway.workers 2: a backend added by a reload is routed to from both workers, and
    one removed gets nothing new from either."""
    a, b = start_sim("a"), start_sim("b")
    gw = start_gateway(_config([a], gateway={"workers": 2}))
    gw.wait_all_ready()
    gw.write_config(_config([b], gateway={"workers": 2}))
    out = gw.reload().json()
    assert out["added"] == ["b"] and out["removed"] == ["a"], out
    gw.wait_state("b", "ready")
    before_a = _served(a)
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    pids = set()
    for _ in range(40):
        with httpx.Client() as fresh:  # a new connection each: both workers get some
            r = fresh.post(f"{gw.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    workers = httpx.get(f"{gw.url}/admin/workers").json()["workers"]
    for w in workers:
        pids.add(w["pid"])
        assert "b" in w["inflight"], w
    assert len(pids) == 2
    assert _served(b) >= 40 and _served(a) == before_a


def _replacement(tmp: Path, gw: Gateway, config: dict[str, Any]) -> Gateway:
    return Gateway(tmp, config, name="gateway-new", args=("--replace", str(gw.pid)))


def test_replacement_under_load_loses_nothing(
    tmp_path: Path,
    procs: list[Proc],
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
) -> None:
    """serve --replace PID: the new one judges the fleet, listens beside the old one, the
    old drains and exits; 0 failed requests, 0 cut streams."""
    a, b = start_sim("a"), start_sim("b")
    old = start_gateway(_config([a, b], streaming={"shutdown_grace": "5s"}))
    old.wait_all_ready()
    config = _config([a, b], gateway={"listen": f"127.0.0.1:{old.port}"})
    with Load(old.url) as load:
        wait_until(lambda: load.ok >= 10, what="load running")
        new = _replacement(tmp_path, old, config)
        procs.append(new)
        assert new.port == old.port
        assert all(v["state"] != "cold" for v in new.backends().values())
        old.popen.wait(timeout=15)
        served_before = load.ok
        wait_until(lambda: load.ok >= served_before + 20, what="load on the new gateway")
    assert old.popen.returncode == 0
    assert load.failures == []
    assert len(load.retried) <= 1, load.retried  # see Load: at most the one race, retried
    assert load.streams > 5


def test_a_replacement_that_cannot_start_leaves_the_old_one_serving(
    tmp_path: Path, start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """A bad config (exit 2), an address another program holds (exit 1), a PID that is not
    a gateway (exit 1): the old gateway is untouched and keeps serving."""
    a = start_sim("a")
    old = start_gateway(_config([a]))
    old.wait_all_ready()
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: []\n")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))  # another program's listener: no SO_REUSEPORT
    holder.listen()
    held = tmp_path / "held.yaml"
    held.write_text(
        f"gateway: {{listen: '127.0.0.1:{holder.getsockname()[1]}'}}\n"
        f"backends: [{{name: a, url: '{a.url}', models: [demo-7b]}}]\n"
    )
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"backends: [{{name: a, url: '{a.url}', models: [demo-7b]}}]\n")
    try:
        runs = [
            (bad, str(old.pid), 2, "backends"),
            (held, str(old.pid), 1, "did not set SO_REUSEPORT"),
            (ok, str(a.pid), 1, "not a pulsegate gateway"),
        ]
        for path, pid, code, words in runs:
            p = subprocess.run(
                [sys.executable, "-m", "pulsegate", "serve", "-c", str(path), "--replace", pid],
                capture_output=True,
                timeout=30,
            )
            assert p.returncode == code, p.stderr
            assert words in p.stderr.decode(), p.stderr
        assert old.alive() and a.alive()
        body = {"model": "demo-7b", "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{old.url}/v1/completions", json=body).status_code == 200
    finally:
        holder.close()


@pytest.mark.parametrize("token", [None, "s3cret"])
def test_pulsegate_reload_cli(
    token: str | None, start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """`pulsegate reload --url`: 0 and what changed; 2 and the errors when refused."""
    a, b = start_sim("a"), start_sim("b")
    env = {"PG_TOKEN": token} if token else None
    extra = {"gateway": {"admin_token_env": "PG_TOKEN"}} if token else {}
    gw = start_gateway(_config([a], **extra), env=env)
    gw.write_config(_config([a, b], **extra))
    run_env = {"PULSEGATE_ADMIN_TOKEN": token} if token else {}
    cli = [sys.executable, "-m", "pulsegate", "reload", "--url", gw.url]
    p = subprocess.run(cli, capture_output=True, env={**os.environ, **run_env}, timeout=30)
    assert p.returncode == 0, p.stderr
    assert b"added: b" in p.stdout
    gw.config_path.write_text("backends: 3\n")
    p = subprocess.run(cli, capture_output=True, env={**os.environ, **run_env}, timeout=30)
    assert p.returncode == 2 and b"backends" in p.stderr, p.stderr


def test_replacement_of_a_multi_worker_gateway(
    tmp_path: Path,
    procs: list[Proc],
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
) -> None:
    """gateway.workers 2 replaced by another 2-worker gateway under load: the old primary
    and its workers exit, no request fails."""
    a = start_sim("a")
    workers = {"workers": 2}
    old = start_gateway(_config([a], gateway=workers))
    old.wait_all_ready()
    old_workers = {w["pid"] for w in httpx.get(f"{old.url}/admin/workers").json()["workers"]}
    config = _config([a], gateway={**workers, "listen": f"127.0.0.1:{old.port}"})
    with Load(old.url, clients=2) as load:
        wait_until(lambda: load.ok >= 10, what="load running")
        new = _replacement(tmp_path, old, config)
        procs.append(new)
        old.popen.wait(timeout=20)
        done = load.ok
        wait_until(lambda: load.ok >= done + 10, what="load on the new gateway")
    assert old.popen.returncode == 0
    for pid in old_workers:
        wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists(), what=f"worker {pid} gone")
    new_workers = {w["pid"] for w in httpx.get(f"{new.url}/admin/workers").json()["workers"]}
    assert len(new_workers) == 2 and not new_workers & old_workers
    assert load.failures == []
    assert len(load.retried) <= 1, load.retried


def test_the_systemd_unit_reloads_with_sighup_and_upgrades_with_replace() -> None:
    """deploy/systemd: ExecReload sends SIGHUP; the start script uses serve --replace."""
    root = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
    unit = (root / "pulsegate@.service").read_text()
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit
    script = (root / "pulsegate-start").read_text()
    assert 'serve -c "$PULSEGATE_CONFIG" --replace "$old"' in script
    p = subprocess.run(
        [sys.executable, "-m", "pulsegate", "serve", "--help"], capture_output=True, timeout=30
    )
    assert b"--replace PID" in p.stdout
