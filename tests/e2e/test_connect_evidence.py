"""Connect evidence (issue #21, item 3), end to end: three real sims behind a real gateway, one
of them reached through a gate (a TCP forwarder in this process) that can stop taking new
connections while the ones it holds keep working - what a SYN drop or a full accept queue
does to a node, without root: the gate stops accepting and its listen backlog is filled, so
the kernel drops further SYNs. The backend must leave `ready` with cause `connect` (issue
target: within 2 s; the figure is printed, the assertion's deadline is functional on a
loaded 2-core box), no client request may fail, and with the gate open again it must come
back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

TARGET_S = 2.0  # issue #21: "SYN drop detected within 2 s"
DEADLINE_S = 8.0  # what the test asserts on a loaded box; the figure is printed
RATE_HZ = 20.0


class Gate:
    """A TCP forwarder to `upstream` on its own loop thread. `close_door()`: no new connection
    gets through (not accepted, the backlog full: SYNs dropped), established ones keep
    forwarding; `open_door()` undoes it."""

    BACKLOG = 64

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(self.BACKLOG)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._fillers: list[socket.socket] = []
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start_accepting)

    def _call(self, fn: Callable[[], object]) -> None:
        done = threading.Event()

        def run() -> None:
            fn()
            done.set()

        self._loop.call_soon_threadsafe(run)
        assert done.wait(5)

    def _start_accepting(self) -> None:
        self._accepting = self._loop.create_task(self._accept())

    async def _accept(self) -> None:
        while True:
            conn, _ = await self._loop.sock_accept(self.sock)
            self.accepted += 1
            task = self._loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            r, w = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            return
        await asyncio.gather(self._pipe(r, up_w), self._pipe(up_r, w))

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    def close_door(self) -> None:
        """Stop accepting, shrink the backlog to none and fill it: the kernel now drops every
        SYN to this port (`LISTENOVERFLOWS`), while established connections keep working."""

        def stop() -> None:
            assert self._accepting is not None
            self._accepting.cancel()

        self._call(stop)
        self.sock.listen(0)
        while True:  # a full queue shows as a connect that does not complete
            s = socket.socket()
            s.settimeout(0.2)
            try:
                s.connect(("127.0.0.1", self.port))
            except (TimeoutError, OSError):
                s.close()
                break
            self._fillers.append(s)
            assert len(self._fillers) < 10, "the backlog does not fill"

    def open_door(self) -> None:
        self.sock.listen(self.BACKLOG)
        for s in self._fillers:
            s.close()
        self._fillers.clear()
        self._call(self._start_accepting)

    def close(self) -> None:
        def stop() -> None:
            for t in [self._accepting, *self._tasks]:
                if t is not None:
                    t.cancel()

        self._call(stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self.sock.close()
        for s in self._fillers:
            s.close()


class Load:
    """A thread sending one small streamed completion every 1/RATE_HZ s until stopped; keeps
    each request's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failed: list[str] = []
        self.latencies: list[float] = []
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
        body = {"model": "demo-7b", "prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.Client(timeout=10) as c:
            while not self._stop.wait(1.0 / RATE_HZ):
                t0 = time.monotonic()
                try:
                    with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        text = r.read()
                    ok = r.status_code == 200 and b"[DONE]" in text
                    why = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    ok, why = False, repr(e)
                self.latencies.append(time.monotonic() - t0)
                if ok:
                    self.ok += 1
                else:
                    self.failed.append(why)


@pytest.fixture
def fleet(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> Iterator[tuple[Gateway, Gate]]:
    sims = {n: start_sim(n) for n in "abc"}
    gate = Gate((sims["a"].host, sims["a"].port))
    entries = [backend_entry(s) for s in sims.values()]
    entries[0]["url"] = f"http://127.0.0.1:{gate.port}"
    config: dict[str, Any] = {
        "backends": entries,
        "probes": fast_probes(),
        "health": {"ejection_base": "500ms", "rejoin_after": 2},
    }
    try:
        gw = start_gateway(config)
        gw.wait_all_ready()
        yield gw, gate
    finally:
        gate.close()


def _left_ready(gw: Gateway, t0: float) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for e in gw.events():
            if e["backend"] == "a" and e["from"] == "ready" and e["ts"] >= t0:
                return dict(e)
        return None

    return wait_until(found, timeout=DEADLINE_S + 5, what="a out of ready")


def test_new_connections_dropped_eject_with_cause_connect_and_no_client_fails(
    fleet: tuple[Gateway, Gate],
) -> None:
    """SYNs dropped to one node whose pooled connections still work: out of ready with cause
    connect, no client request failed, and back once new connections are taken again."""
    gw, gate = fleet
    with Load(gw.url) as load:
        wait_until(lambda: load.ok >= 30, timeout=20, what="warm-up traffic")
        i0, t0 = len(load.latencies), time.time()
        gate.close_door()
        event = _left_ready(gw, t0)
        took = event["ts"] - t0
        during = load.latencies[i0:]
        print(f"\nnew connections dropped -> {event['to']} in {took:.2f} s: {event['reason']}")
        print(f"client latency max {max(during, default=0) * 1e3:.0f} ms until detected")
        assert event["to"] == "ejected" and event["cause"] == "connect", event
        assert "new connections failed in a row" in event["reason"], event
        assert took <= DEADLINE_S, f"detected {took:.2f}s after the fault"
        view = gw.backends()["a"]
        assert view["connect_failures"] >= 3, view
        # Still out a few connect-probe intervals later: the evidence stands while new
        # connections fail, however well the pooled ones serve the other probes.
        n, i1 = len(gw.events()), len(load.latencies)
        wait_until(lambda: len(load.latencies) >= i1 + 30, timeout=10, what="30 more requests")
        assert gw.backends()["a"]["state"] == "ejected"
        assert not [e for e in gw.events()[n:] if e["backend"] == "a" and e["to"] != "ejected"]
        t1 = time.time()
        gate.open_door()
        gw.wait_state("a", "probation", "ready", timeout=20)
        print(f"new connections taken again -> probation in {time.time() - t1:.2f} s")
    assert not load.failed, load.failed
    others = [e for e in gw.events() if e["backend"] != "a" and e["to"] == "ejected"]
    assert not others, others
