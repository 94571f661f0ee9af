"""`gateway.workers: 2`: one health process, two proxy workers on one port (cluster/).

Real processes on loopback: simulated engines and `pulsegate serve`. Every request goes on
a new connection, so the kernel spreads them over both workers (SO_REUSEPORT hashes the
connection's addresses). Worker PIDs come from `GET /admin/workers`; every process, workers
included, is stopped by PID.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

MODEL = "demo-7b"
SLOW_PROBES = {
    "readiness": {"interval": "20s", "interval_unstable": "20s"},
    "micro_inference": {"interval": "20s", "jitter": "0s"},
    "canary": {"interval": "20s"},
}
# Failures are retried elsewhere: a client sees 200 while a backend is being ejected.
RETRY = {"max_attempts": 3, "budget_ratio": 1.0}


def _fresh() -> httpx.Client:
    """A client that opens a new connection per request (spread over the workers)."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=20)


def _chat(c: httpx.Client, gw: Gateway, tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    return c.post(f"{gw.url}/v1/chat/completions", json=body)


def _workers(gw: Gateway) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/admin/workers", timeout=5)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def _metric_sum(gw: Gateway, name: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", timeout=5).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def worker_pids() -> Iterator[set[int]]:
    """Worker PIDs seen by a test: any still running at the end are killed (no orphans even
    when the test failed before its gateway stopped them)."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _start(
    start_gateway: Callable[..., Gateway],
    pids: set[int],
    sims: list[Sim],
    probes: dict[str, Any],
    workers: int = 2,
    **extra: Any,
) -> Gateway:
    backends = extra.pop("backends", None) or [backend_entry(s) for s in sims]
    cfg = {"gateway": {"workers": workers}, "backends": backends, "probes": probes, **extra}
    gw = start_gateway(cfg)
    if workers > 1:
        pids.update(w["pid"] for w in _workers(gw)["workers"])
    gw.wait_all_ready()
    return gw


def test_both_workers_serve_and_one_metrics_shows_everything(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """Requests land on both workers (two PIDs, neither the primary's); /metrics, the admin
    view and /v1/models answer for the whole gateway whichever worker is asked."""
    sims = [start_sim(n) for n in "ab"]
    gw = _start(start_gateway, worker_pids, sims, fast_probes())
    view = _workers(gw)
    pids = {w["pid"] for w in view["workers"]}
    assert len(pids) == 2 and view["pid"] not in pids and gw.pid == view["pid"]

    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", http_client=_fresh())
    n_plain, n_stream = 30, 10
    for _ in range(n_plain):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert out.choices[0].message.content
    for _ in range(n_stream):
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
    sent = n_plain + n_stream

    # Each worker's counts reach the primary within a stats interval: poll, no sleeping.
    wait_until(
        lambda: _metric_sum(gw, "pulsegate_requests_total") == sent,
        timeout=5,
        what="every request counted once in /metrics",
    )
    assert _metric_sum(gw, "pulsegate_request_seconds_count") == sent
    assert _metric_sum(gw, "pulsegate_ttft_seconds_count") == n_stream
    served = wait_until(
        lambda: (ws := _workers(gw)["workers"]) and sum(w["requests"] for w in ws) == sent and ws,
        timeout=5,
        what="per-worker counts",
    )
    assert all(w["requests"] > 0 for w in served), served  # both workers served

    with _fresh() as c:  # the same answers on ten new connections (either worker)
        answers = {c.get(f"{gw.url}/v1/models").text for _ in range(10)}
        assert len(answers) == 1 and MODEL in answers.pop()
        states = {
            tuple(
                sorted(
                    (b["name"], b["state"])
                    for b in c.get(f"{gw.url}/admin/backends").json()["backends"]
                )
            )
            for _ in range(10)
        }
        assert states == {(("a", "ready"), ("b", "ready"))}
        assert c.get(f"{gw.url}/healthz").text == "ok"
        assert c.get(f"{gw.url}/nope").status_code == 404


def test_admin_token_is_checked_through_the_workers(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    worker_pids: set[int],
) -> None:
    """Admin calls relayed by a worker keep the bearer-token check: refused without it."""
    sims = [start_sim("a")]
    cfg = {
        "gateway": {"workers": 2, "admin_token_env": "PG_TEST_TOKEN"},
        "backends": [backend_entry(sims[0])],
        "probes": fast_probes(),
    }
    gw = start_gateway(cfg, env={"PG_TEST_TOKEN": "s3cret"})
    with _fresh() as c:
        for _ in range(6):
            assert c.get(f"{gw.url}/admin/backends").status_code == 401
            r = c.get(f"{gw.url}/admin/workers", headers={"authorization": "Bearer s3cret"})
            assert r.status_code == 200
            worker_pids.update(w["pid"] for w in r.json()["workers"])


def test_a_backend_ejected_by_the_primary_gets_no_traffic_from_any_worker(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """The primary's probes eject a backend whose engine hangs (CUDA hang: HTTP health still
    200); afterwards neither worker sends it a single client request."""
    sims = {n: start_sim(n) for n in "ab"}
    gw = _start(start_gateway, worker_pids, list(sims.values()), fast_probes(), retry=RETRY)
    sims["b"].fault("cuda_hang")
    gw.wait_state("b", "ejected", timeout=15)
    before = sims["b"].stats()["client_requests_total"]
    with _fresh() as c:
        results = [_chat(c, gw) for _ in range(40)]
    assert [r.status_code for r in results] == [200] * 40
    assert {r.headers["x-pulsegate-backend"] for r in results} == {"a"}
    assert sims["b"].stats()["client_requests_total"] == before
    wait_until(
        lambda: all(w["requests"] > 0 for w in _workers(gw)["workers"]),
        timeout=5,
        what="both workers served",
    )


def test_client_failures_seen_by_the_workers_eject_the_backend(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """With probes too slow to notice, 5xx answers seen by the workers flow back to the
    health core and eject the backend; clients never see them (retried elsewhere)."""
    sims = {n: start_sim(n) for n in "ab"}
    gw = _start(start_gateway, worker_pids, list(sims.values()), SLOW_PROBES, retry=RETRY)
    sims["b"].fault("error", rate=1.0)
    stop = threading.Event()

    def load() -> list[int]:
        codes = []
        with _fresh() as c:
            while not stop.is_set():
                codes.append(_chat(c, gw).status_code)
        return codes

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(load) for _ in range(4)]
        try:
            gw.wait_state("b", "ejected", timeout=30)
        finally:
            stop.set()
        codes = [code for f in futs for code in f.result()]
    assert set(codes) == {200}
    ev = [e for e in gw.events() if e["backend"] == "b" and e["to"] == "ejected"]
    # Only client requests count consecutive failures (a probe it pokes may fail too and
    # give the ejection its cause, but the streak is the workers' evidence).
    assert ev and ev[0]["signals"]["consecutive_failures"] >= 1, ev


def test_probe_traffic_with_two_workers_is_that_of_one(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """Probes come from the primary alone: the engines see about the same probe rate with
    two workers as with one (two independent gateways would double it)."""
    sims = [start_sim(n) for n in "ab"]
    # One micro-inference and one canary a second per backend, with timeouts so long that a
    # busy test machine does not fail a probe (a failure triples the cadence for 30 s).
    probes = {
        "readiness": {"interval": "1s", "interval_unstable": "1s", "timeout": "1s"},
        "micro_inference": {"interval": "1s", "jitter": "0s", "timeout": "1s"},
        "canary": {"interval": "1s", "timeout": "1s"},
    }

    def probe_rate(workers: int) -> float:
        gw = _start(start_gateway, worker_pids, sims, probes, workers=workers)
        # Counted over the same number of wall seconds for both: a rate, not a settle wait.
        t0, n0 = time.monotonic(), sum(s.stats()["probe_requests_total"] for s in sims)
        wait_until(lambda: time.monotonic() - t0 >= 4.0, timeout=6, what="4 s of probes")
        n1 = sum(s.stats()["probe_requests_total"] for s in sims)
        rate = (n1 - n0) / (time.monotonic() - t0)
        gw.stop()
        return rate

    one = probe_rate(1)
    two = probe_rate(2)
    assert one > 0
    assert two < 1.5 * one, (one, two)  # doubled probes would be ~2x


def test_max_inflight_holds_across_workers(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """16 concurrent requests through two workers on two backends limited to 2 each: all
    succeed (queued), and no backend ever has more than 2 in flight gateway-wide."""
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "20") for n in "ab"}
    gw = _start(
        start_gateway,
        worker_pids,
        list(sims.values()),
        SLOW_PROBES,
        backends=[backend_entry(s, max_inflight=2) for s in sims.values()],
        routing={"queue_timeout": "20s"},
    )
    peak_gw = dict.fromkeys(sims, 0)
    peak_sim = dict.fromkeys(sims, 0)
    with (
        httpx.Client(limits=httpx.Limits(max_connections=32), timeout=30) as client,
        concurrent.futures.ThreadPoolExecutor(16) as pool,
    ):
        futs = [pool.submit(_chat, client, gw, 10) for _ in range(16)]
        while not all(f.done() for f in futs):
            for name, b in gw.backends().items():
                peak_gw[name] = max(peak_gw[name], b["inflight"])
            for name, s in sims.items():
                peak_sim[name] = max(peak_sim[name], s.stats()["inflight"])
        codes = [f.result().status_code for f in futs]
    assert codes == [200] * 16
    assert max(peak_sim.values()) <= 2, peak_sim  # slow probes: the sims see client requests
    assert max(peak_gw.values()) <= 2, peak_gw
    served = wait_until(
        lambda: (ws := _workers(gw)["workers"]) and sum(w["requests"] for w in ws) == 16 and ws,
        timeout=5,
        what="per-worker counts",
    )
    assert all(w["requests"] > 0 for w in served), served


def test_a_killed_worker_is_replaced(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """SIGKILL one worker: the primary records it and starts another in its slot; the
    gateway keeps answering."""
    sims = [start_sim("a")]
    gw = _start(start_gateway, worker_pids, sims, fast_probes())
    victim = _workers(gw)["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    slot = wait_until(
        lambda: (w := _workers(gw)["workers"][0])["pid"] != victim["pid"] and w["ready"] and w,
        timeout=15,
        what="a new worker in slot 0",
    )
    worker_pids.add(slot["pid"])
    assert slot["restarts"] == 1 and not _alive(victim["pid"])
    ev = [e for e in gw.events() if e["backend"] == "worker-0"]
    assert ev and str(victim["pid"]) in ev[0]["reason"] and "signal 9" in ev[0]["reason"]
    with _fresh() as c:
        assert [_chat(c, gw).status_code for _ in range(10)] == [200] * 10


def test_sigterm_drains_a_stream_and_leaves_no_process(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """SIGTERM to the primary: a stream in flight finishes with [DONE] within the grace,
    then the primary and both workers exit."""
    sims = [start_sim("a", "--itl-ms", "20")]
    gw = _start(start_gateway, worker_pids, sims, SLOW_PROBES)
    pids = {w["pid"] for w in _workers(gw)["workers"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40}
    with httpx.stream(
        "POST", f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, timeout=20
    ) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        gw.signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert first and rest[-1] == "data: [DONE]"
    assert gw.popen.wait(timeout=15) == 0
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=10, what="workers gone")


def test_workers_exit_when_the_primary_is_killed(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], worker_pids: set[int]
) -> None:
    """SIGKILL to the primary (no chance to stop anything): the workers notice and exit."""
    sims = [start_sim("a")]
    gw = _start(start_gateway, worker_pids, sims, fast_probes())
    pids = {w["pid"] for w in _workers(gw)["workers"]}
    gw.kill()
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=15, what="workers gone")
