"""The gateway's own stalls: measured by `SystemClock`, and never held against a backend
by the deadlines of `pulsegate.stall`.

The stalls here are real: the test blocks its own event loop with `time.sleep`, as a
starved or throttled gateway process would find it blocked. The peers are real sockets
served from a thread, so they answer while the loop stands still. Each test makes its
`SystemClock` in its own running loop (the `sysclock` fixture), as the gateway does once.
"""

from __future__ import annotations

import asyncio
import http.server
import socketserver
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import pytest

from pulsegate import clock, stall
from pulsegate.clock import SystemClock
from pulsegate.probers.http import fetch, new_probe_session


class _Handler(http.server.BaseHTTPRequestHandler):
    delay_s = 0.0

    def do_GET(self) -> None:
        time.sleep(self.delay_s)
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    block_on_close = False


@pytest.fixture
def serve() -> Iterator[Callable[[float], str]]:
    """`serve(delay)` -> the URL of a loopback server answering after `delay` seconds."""
    servers: list[_Server] = []

    def start(delay: float) -> str:
        handler = type("H", (_Handler,), {"delay_s": delay})
        srv = _Server(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
async def sysclock() -> AsyncIterator[SystemClock]:
    """A `SystemClock` of the test's running loop, its tick stopped afterwards."""
    c = SystemClock(asyncio.get_running_loop())
    yield c
    c.close()


def _block_loop_soon(seconds: float, after: float = 0.01) -> None:
    """Stall this loop for `seconds`, `after` seconds from now (the gateway descheduled)."""
    asyncio.get_running_loop().call_later(after, time.sleep, seconds)


async def _fetch(
    session: aiohttp.ClientSession, url: str, timeout_s: float, sysclock: SystemClock
) -> int:
    reply = await fetch(session, "GET", url, headers={}, timeout_s=timeout_s, clock=sysclock)
    return reply.status


# -- SystemClock's stall measurement -------------------------------------------------------


async def test_a_blocked_loop_is_a_stall_even_before_the_clock_ticks(
    sysclock: SystemClock,
) -> None:
    """A stall in progress counts from the overdue tick, then is recorded with its length."""
    w = sysclock
    t0 = w.now()
    time.sleep(0.3)  # noqa: ASYNC251 - the stall under test
    # Nothing else has run yet: the stall in progress is counted from the overdue tick.
    assert 0.25 <= w.stalled(t0, w.now()) <= 0.5
    assert clock.excuse(w, t0, w.now()) == pytest.approx(w.stalled(t0, w.now()), abs=0.01)
    before = w.stalls.count
    await asyncio.sleep(0.05)
    assert w.stalls.count >= before + 1  # (a loaded box may add one of its own)
    assert 0.25 <= w.stalls.longest_s <= 0.5
    assert 0.25 <= w.stalled(t0, w.now()) <= 0.5
    # Nothing stood still after it.
    now = w.now()
    assert w.stalled(now, now) == 0.0


async def test_a_running_loop_records_no_stall(sysclock: SystemClock) -> None:
    """Timer jitter is not a stall. A window in which this process really was descheduled
    (a loaded box: one of our own sleeps came back over 20 ms late) proves nothing either
    way, so the test looks for a clean one, five windows at most."""
    w = sysclock
    for _ in range(5):
        t0 = w.now()
        worst = 0.0
        for _ in range(20):
            t = w.now()
            await asyncio.sleep(0.01)
            worst = max(worst, w.now() - t - 0.01)
        if worst < 0.02:
            break
    else:
        pytest.fail("no quiet 0.2 s window in five: this process keeps being descheduled")
    assert clock.excuse(w, t0, w.now()) == 0.0
    assert clock.running(w, t0, w.now()) == pytest.approx(w.now() - t0, abs=0.01)


async def test_a_long_stall_is_logged_once_with_its_length(
    caplog: pytest.LogCaptureFixture, sysclock: SystemClock
) -> None:
    """Two 300 ms stalls within the rate limit make one warning line, with the length."""
    with caplog.at_level("WARNING", logger="pulsegate.stall"):
        time.sleep(0.3)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 - a second one, inside the rate limit
        await asyncio.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "pulsegate.stall"]
    assert len(lines) == 1, lines
    assert "event loop stood still for" in lines[0] and "ms" in lines[0]


# -- deadlines ---------------------------------------------------------------------------


async def test_an_answer_that_came_during_our_stall_is_not_a_timeout(
    serve: Callable[[float], str], sysclock: SystemClock
) -> None:
    """The peer answers after 30 ms, while our loop stands still from 10 to 310 ms, past the
    100 ms deadline. A plain deadline calls that a timeout; the probe's reads the answer."""
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")  # conftest.py
    url = serve(0.03)
    async with new_probe_session() as session:
        assert await _fetch(session, url, 1.0, sysclock) == 200  # the connection is pooled
        _block_loop_soon(0.3)
        assert await _fetch(session, url, 0.1, sysclock) == 200

        async def plain() -> None:
            async with asyncio.timeout(0.1):
                async with session.get(url) as r:
                    await r.read()

        _block_loop_soon(0.3)
        with pytest.raises(TimeoutError):  # what the probe would have said before
            await plain()


async def test_a_silent_peer_still_times_out_after_a_stall(
    serve: Callable[[float], str], sysclock: SystemClock
) -> None:
    """The deadline is pushed back by our stall, not dropped: a peer that never answers
    in time still fails, after the deadline's worth of time we were actually running."""
    url = serve(5.0)
    loop = asyncio.get_running_loop()
    async with new_probe_session() as session:
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await _fetch(session, url, 0.1, sysclock)
        plain = loop.time() - t0
        _block_loop_soon(0.3)
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await _fetch(session, url, 0.1, sysclock)
        stalled = loop.time() - t0
    assert plain < 0.3
    assert 0.38 <= stalled < 1.0  # 0.1 s of running time + the 0.3 s stall


async def test_stall_timeout_without_a_stall_is_a_plain_timeout(sysclock: SystemClock) -> None:
    """Without a stall, `stall.timeout` expires on time and leaves nothing when met."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        async with stall.timeout(sysclock, 0.05):
            await asyncio.sleep(1)
    assert 0.045 <= loop.time() - t0 < 0.2
    async with stall.timeout(sysclock, 0.5):
        await asyncio.sleep(0.01)  # done in time: nothing raised, nothing left behind


async def test_a_deadline_is_pushed_back_at_most_max_extensions_times(
    sysclock: SystemClock,
) -> None:
    """A gateway stalled more than it runs still reaches its verdicts."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def stalls() -> None:
        async with stall.timeout(sysclock, 0.05):
            for _ in range(stall.MAX_EXTENSIONS + 3):
                time.sleep(0.1)  # noqa: ASYNC251 - stall after stall
                await asyncio.sleep(0.001)

    with pytest.raises(TimeoutError):
        await stalls()
    assert loop.time() - t0 < 0.1 * (stall.MAX_EXTENSIONS + 2) + 0.1
