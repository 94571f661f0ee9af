"""The gateway's connection cap and its header / body timeouts, on a real `pulsegate serve`.

Raw sockets on loopback (`conn_guard.py`, `runtime.client_site`, `proxy/forward.py`): past
`gateway.max_client_connections` a new connection gets a whole 503 at once and is closed
while the open ones keep working; a head trickled past `client_header_timeout` gets a 408;
a body past `client_body_timeout` too; an idle keep-alive connection, a normal request and
a long stream are never cut by either. While each case is in flight `/healthz` is asked on
another connection and the worst time printed (`-s`); the tests assert only "not frozen"
(1 s), never a timing.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import Gateway, Reply, Sim, backend_entry, fast_probes, wait_until
from support import read_replies as _read

CAP = 8
HEAD_S = 1.0  # client_header_timeout in these tests
BODY_S = 1.0  # client_body_timeout
FROZEN_S = 1.0
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
CHAT = b'{"model":"demo-7b","messages":[{"role":"user","content":"hi"}],"max_tokens":%d%s}'


def _config(sim: Sim, **gateway: Any) -> dict[str, Any]:
    g = {
        "max_client_connections": CAP,
        "client_header_timeout": HEAD_S,
        "client_body_timeout": BODY_S,
        "client_idle_timeout": 30.0,  # far away: what is cut here is cut by the new bounds
        **gateway,
    }
    return {"gateway": g, "backends": [backend_entry(sim)], "probes": fast_probes()}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("conn-guard")
    sim = Sim(tmp, "a", "--itl-ms", "50")  # 80 tokens: a 4 s stream
    try:
        g = Gateway(tmp, _config(sim))
        try:
            g.wait_all_ready()
            yield g
        finally:
            g.stop()
    finally:
        sim.stop()


def _served(gw: Gateway) -> tuple[socket.socket, Reply]:
    """A new connection, proven served by one /healthz answered 200 on it (kept open)."""
    s = socket.create_connection((gw.host, gw.port), timeout=10)
    s.sendall(HEALTHZ)
    reply = _read(s, Reply(), 1)
    return s, reply


def _healthz(gw: Gateway, s: socket.socket | None = None) -> float:
    """One /healthz, timed: on `s` (kept open) or a new connection (closed after)."""
    t0 = time.monotonic()
    own = s is None
    conn = socket.create_connection((gw.host, gw.port), timeout=10) if s is None else s
    try:
        conn.sendall(HEALTHZ if not own else HEALTHZ[:-2] + b"Connection: close\r\n\r\n")
        reply = _read(conn, Reply(), 1)
    finally:
        if own:
            conn.close()
    took = time.monotonic() - t0
    assert reply.statuses == [200], (reply.statuses, reply.bodies)
    assert took < FROZEN_S, f"/healthz took {took:.2f}s"
    return took


def _while(gw: Gateway, case: str, busy: threading.Thread, on: socket.socket | None = None) -> None:
    """/healthz again and again (on `on`, else on new connections) while `busy` runs;
    prints the worst time."""
    times = [_healthz(gw, on)]
    while busy.is_alive() and len(times) < 500:
        times.append(_healthz(gw, on))
    busy.join(timeout=30)
    print(f"{case}: /healthz x{len(times)} worst {max(times) * 1000:.1f} ms")


def _metric(gw: Gateway, name: str, s: socket.socket | None = None) -> float:
    """A metric's value from /metrics (on `s`, kept open, else a new connection)."""
    if s is None:
        text = httpx.get(f"{gw.url}/metrics", headers={"connection": "close"}, timeout=5).text
    else:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        text = _read(s, Reply(), 1).bodies[0].decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _quiet(gw: Gateway) -> None:
    """Every connection of the test's helpers closed: only the asking one is counted."""
    wait_until(
        lambda: _metric(gw, "pulsegate_client_connections") <= 1,
        timeout=10,
        what="the helpers' connections closed",
    )


# -- the cap ------------------------------------------------------------------------------------


def test_past_the_cap_a_new_connection_gets_a_503_at_once_and_the_old_ones_work(
    gw: Gateway,
) -> None:
    """CAP connections served; the next gets a whole 503 (`overloaded`, Retry-After: 1,
    Connection: close) without sending a byte, and is closed; an old one still answers;
    the gauge and the refusals' count say so; after two close, a new one is served."""
    _quiet(gw)
    held = [_served(gw) for _ in range(CAP)]
    try:
        assert all(r.statuses == [200] for _, r in held), [r.statuses for _, r in held]
        refused_before = _metric(gw, "pulsegate_client_connections_refused_total", held[0][0])
        t0 = time.monotonic()
        with socket.create_connection((gw.host, gw.port), timeout=10) as s:
            reply = _read(s, Reply(), 2)  # one answer, then the close
        took = time.monotonic() - t0
        print(f"refused at the cap: 503 and closed in {took * 1000:.1f} ms")
        assert reply.statuses == [503] and reply.closed, (reply.statuses, reply.closed)
        assert reply.code() == "overloaded"
        assert reply.headers[0]["retry-after"] == "1"
        assert reply.headers[0]["connection"].lower() == "close"
        s0 = held[0][0]
        assert _metric(gw, "pulsegate_client_connections", s0) == CAP
        assert _metric(gw, "pulsegate_client_connections_refused_total", s0) == refused_before + 1

        def flood() -> None:  # new connections refused, again and again, for ~1 s
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                with socket.create_connection((gw.host, gw.port), timeout=10) as c:
                    r = _read(c, Reply(), 2)
                    assert r.statuses == [503], r.statuses

        t = threading.Thread(target=flood)
        t.start()
        _while(gw, "refusal flood, /healthz on a held connection", t, on=held[1][0])
        for s, _ in held[:2]:
            s.close()
        held = held[2:]
        s_new, r_new = wait_until(
            lambda: (got := _served(gw))[1].statuses == [200] and got,
            timeout=10,
            what="a new connection served once two closed",
        )
        held.append((s_new, r_new))
    finally:
        for s, _ in held:
            s.close()


# -- the header timeout -------------------------------------------------------------------------


def _trickle(
    gw: Gateway, first: bytes, byte: bytes, every: float = 0.1, wait: float = 1.0
) -> tuple[float, Reply]:
    """Send `first`, then `byte` every `every` s until the gateway answers or closes (at
    most 6 s); returns the seconds after `first` and what came back (read on for up to
    `wait` s: an answer, then a close)."""
    s = socket.create_connection((gw.host, gw.port), timeout=10)
    reply = Reply()
    try:
        s.sendall(first)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6.0:
            readable, _, _ = select.select([s], [], [], every)
            if readable:
                took = time.monotonic() - t0
                return took, _read(s, reply, 2, wait)
            try:
                s.send(byte)
            except OSError:
                took = time.monotonic() - t0
                return took, _read(s, reply, 2, wait)
        raise AssertionError("held past 6 s")
    finally:
        s.close()


def test_a_trickled_head_gets_a_408_and_is_closed_at_the_header_timeout(gw: Gateway) -> None:
    """A header byte every 100 ms: 408 `request_timeout` and closed about
    `client_header_timeout` after the head's first byte; /healthz answers meanwhile."""
    out: list[tuple[float, Reply]] = []
    t = threading.Thread(
        target=lambda: out.append(_trickle(gw, b"GET /healthz HTTP/1.1\r\n", b"X"))
    )
    t.start()
    _while(gw, "trickled head", t)
    took, reply = out[0]
    print(f"trickled head: {reply.statuses} after {took:.2f} s")
    assert reply.statuses == [408] and reply.closed, (reply.statuses, reply.closed)
    assert reply.code() == "request_timeout"
    assert HEAD_S * 0.9 < took < HEAD_S + 2.0, took


def test_the_header_timeout_runs_per_head_on_a_keep_alive_connection(gw: Gateway) -> None:
    """On a connection that was answered once, a second head trickled gets the 408 too."""
    s, first = _served(gw)
    try:
        assert first.statuses == [200]
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6.0:
            if select.select([s], [], [], 0.1)[0]:
                break
            s.send(b"X")
        reply = _read(s, Reply(), 2)
        assert reply.statuses == [408] and reply.closed, (reply.statuses, reply.closed)
    finally:
        s.close()


def test_an_idle_connection_is_not_cut_by_the_header_timeout(gw: Gateway) -> None:
    """A keep-alive connection sending nothing for 3x the header timeout, and a new one
    that never sent a byte, are both still open and served after."""
    s1, first = _served(gw)
    s2 = socket.create_connection((gw.host, gw.port), timeout=10)
    try:
        assert first.statuses == [200]
        readable, _, _ = select.select([s1, s2], [], [], 3 * HEAD_S)  # a close is readable
        assert not readable, "an idle connection was closed (or written to)"
        for s in (s1, s2):
            s.sendall(HEALTHZ)
            assert _read(s, Reply(), 1).statuses == [200]
    finally:
        s1.close()
        s2.close()


def test_after_a_413_the_unread_body_is_no_head(gw: Gateway) -> None:
    """A body past the limit is answered 413 before it is read; the rest of it, then 3x the
    header timeout of silence, bring no 408: the connection serves its next request."""
    body = b"x" * (5 << 20)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection((gw.host, gw.port), timeout=10) as s:
        s.sendall(head % len(body))
        first = _read(s, Reply(), 1)
        assert first.statuses == [413], first.statuses
        s.sendall(body)
        assert not select.select([s], [], [], 3 * HEAD_S)[0], "written to or closed"
        s.sendall(HEALTHZ)
        assert _read(s, Reply(), 1).statuses == [200]


def test_a_head_in_two_parts_within_the_timeout_is_served(gw: Gateway) -> None:
    """A head sent in two writes 0.5 s apart (under the header timeout) is answered."""
    with socket.create_connection((gw.host, gw.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        select.select([s], [], [], 0.5 * HEAD_S)
        s.sendall(b"Host: x\r\n\r\n")
        assert _read(s, Reply(), 1).statuses == [200]


# -- the body timeout ---------------------------------------------------------------------------


def test_a_trickled_body_gets_the_body_timeouts_408(gw: Gateway) -> None:
    """A body byte every 100 ms: 408 `request_timeout` about `client_body_timeout` after
    its head; /healthz answers meanwhile."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    out: list[tuple[float, Reply]] = []
    t = threading.Thread(target=lambda: out.append(_trickle(gw, head, b" ")))
    t.start()
    _while(gw, "trickled body", t)
    took, reply = out[0]
    print(f"trickled body: {reply.statuses} after {took:.2f} s")
    assert reply.statuses == [408], reply.statuses
    assert reply.code() == "request_timeout"
    assert BODY_S * 0.9 < took < BODY_S + 2.0, took


# -- never cut ----------------------------------------------------------------------------------


def test_a_normal_request_and_a_long_stream_are_never_cut(gw: Gateway) -> None:
    """A chat answer, and a 4 s stream (4x both timeouts) on a keep-alive connection, whole;
    then a request on the same connection."""
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=CHAT % (4, b""))
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        with c.stream(
            "POST", "/v1/chat/completions", content=CHAT % (80, b',"stream":true')
        ) as resp:
            assert resp.status_code == 200
            text = b"".join(resp.iter_bytes())
        took = time.monotonic() - t0
        assert text.rstrip().endswith(b"data: [DONE]"), text[-200:]
        assert took > 2.5 * HEAD_S, f"the stream was quicker than meant ({took:.2f} s)"
        assert c.get("/healthz").status_code == 200


# -- reload, and gateway.workers: 2 -------------------------------------------------------------


def test_a_reload_applies_the_body_timeout_and_says_the_others_need_a_replacement(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """`client_body_timeout` applies at reload; `client_header_timeout`,
    `max_client_connections` and `client_idle_timeout` are listed under `needs_replace`."""
    sim = start_sim("a")
    gw = start_gateway(_config(sim))
    gw.wait_all_ready()
    gw.write_config(
        _config(
            sim,
            client_body_timeout=20.0,
            client_header_timeout=5.0,
            max_client_connections=100,
            client_idle_timeout=40.0,
        )
    )
    out = gw.reload().json()
    assert out["ok"], out
    assert sorted(out["needs_replace"]) == [
        "gateway.client_header_timeout",
        "gateway.client_idle_timeout",
        "gateway.max_client_connections",
    ]


def test_with_two_workers_each_holds_its_cap_and_times_heads(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """`gateway.workers: 2`, cap 4: of 30 new connections (spread by SO_REUSEPORT) exactly
    8 are served, 4 per worker, the rest get the 503; the summed gauge says 8; a trickled
    head gets the 408."""
    sim = start_sim("a")
    gw = start_gateway(_config(sim, workers=2, max_client_connections=4))
    gw.wait_all_ready()
    _quiet(gw)
    conns = [_served(gw) for _ in range(30)]
    try:
        statuses = sorted(r.statuses[0] for _, r in conns)
        assert statuses.count(200) == 8 and statuses.count(503) == 22, statuses
        s0 = next(s for s, r in conns if r.statuses == [200])
        wait_until(
            lambda: _metric(gw, "pulsegate_client_connections", s0) == 8,
            timeout=5,
            what="the workers' gauges summed",
        )
        wait_until(
            lambda: _metric(gw, "pulsegate_client_connections_refused_total", s0) == 22,
            timeout=5,
            what="the workers' refusals summed",
        )
    finally:
        for s, _ in conns:
            s.close()
    _quiet(gw)
    took, reply = _trickle(gw, b"GET /healthz HTTP/1.1\r\n", b"X")
    assert reply.statuses == [408] and reply.closed, (reply.statuses, took)
