"""A raw-socket fuzz of the gateway's HTTP front: one real `pulsegate serve` and one sim.

Each case writes bytes no well-behaved client sends (bad request lines, header floods,
pipelining, broken chunked bodies, `Expect: 100-continue`, JSON edge cases) and must get a
clear 4xx (OpenAI's error shape where the request reached our handler) or a closed
connection, with the gateway alive afterwards. While each case is in flight, `/healthz` is
asked on another connection and its time printed (`healthz during CASE: N ms`; run with
`-s` to see them); the test asserts only a generous 1 s ("not frozen"), never a timing.
Slowloris (a head or a body trickled a byte at a time) is cut by `client_header_timeout` /
`client_body_timeout` (`conn_guard.py`, `proxy/forward.py`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httptools
import pytest

from support import Gateway, Sim, backend_entry, fast_probes

CHAT = b"/v1/chat/completions"
FROZEN_S = 1.0  # far above the ~ms /healthz takes: only "the loop is not stuck"
IDLE_S = 1.5  # `gateway.client_idle_timeout`
SLOW_S = 1.0  # `client_header_timeout` and `client_body_timeout`: slowloris is cut after it


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("front-fuzz")
    sim = Sim(tmp, "a")
    try:
        cfg = {
            "gateway": {
                "client_idle_timeout": IDLE_S,
                "client_header_timeout": SLOW_S,
                "client_body_timeout": SLOW_S,
            },
            "backends": [backend_entry(sim)],
            # The 4 MiB cases keep the one sim busy ~1 s (more on a loaded box): probes
            # that time out twice meanwhile eject it, and the ejection cuts the request.
            "probes": {
                **fast_probes(),
                "canary": {"interval": "3s", "timeout": "3s"},
                "micro_inference": {"interval": "3s", "jitter": "0s", "timeout": "3s"},
            },
        }
        g = Gateway(tmp, cfg)
        try:
            g.wait_all_ready()
            yield g
        finally:
            g.stop()
    finally:
        sim.stop()


class Reply:
    """What came back on the socket: the responses parsed, and whether it was closed."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self.closed = False
        self._body = b""
        self._p = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        self._p.feed_data(data)

    def on_message_begin(self) -> None:
        self._body = b""

    def on_body(self, b: bytes) -> None:
        self._body += b

    def on_message_complete(self) -> None:
        self.statuses.append(self._p.get_status_code())
        self.bodies.append(self._body)


def _healthz(gw: Gateway, case: str) -> float:
    """One /healthz on a fresh connection (connect, request, whole answer), timed on the
    monotonic clock and printed. A raw socket: an httpx client's own setup costs ~30 ms."""
    t0 = time.monotonic()
    with socket.create_connection((gw.host, gw.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = Reply()
        while not reply.statuses and (data := s.recv(65536)):
            reply.feed(data)
    took = time.monotonic() - t0
    assert reply.statuses == [200]
    assert took < FROZEN_S, f"/healthz took {took:.2f}s during {case}"
    return took


def _exchange(
    gw: Gateway, case: str, raw: bytes, want: int = 1, wait: float = 10.0, eof: bool = False
) -> Reply:
    """Write `raw` and read until `want` responses or the gateway closes, within `wait`
    seconds, from a thread; meanwhile /healthz is asked again and again on other
    connections (at least once, at most 200 times) and the worst time printed. `eof`: shut
    our sending side after `raw` (a client that gave up mid-body)."""
    s = socket.create_connection((gw.host, gw.port), timeout=wait)
    reply = Reply()

    def talk() -> None:
        try:
            s.sendall(raw)
            if eof:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the gateway refused and closed while we were still sending
            pass
        deadline = time.monotonic() + wait
        while len(reply.statuses) < want and time.monotonic() < deadline:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                data = b""
            if not data:
                reply.closed = True
                return
            try:
                reply.feed(data)
            except httptools.HttpParserError:
                return

    t = threading.Thread(target=talk)
    t.start()
    try:
        times = [_healthz(gw, case)]
        while t.is_alive() and len(times) < 200:
            times.append(_healthz(gw, case))
    finally:
        t.join(timeout=wait + 5)
        s.close()
    codes = [_code(b) for b in reply.bodies]
    print(f"{case}: statuses {reply.statuses} codes {codes} closed {reply.closed}; "
          f"/healthz x{len(times)} worst {max(times) * 1000:.1f} ms")  # fmt: skip
    assert gw.alive()
    return reply


def _code(body: bytes) -> object:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _post(body: bytes, *headers: bytes, path: bytes = CHAT) -> bytes:
    head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"".join(h + b"\r\n" for h in headers)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _openai_error(reply: Reply, status: int) -> dict[str, object]:
    """The one response is `status` in OpenAI's error shape; returns its `error` object."""
    assert reply.statuses == [status], (reply.statuses, reply.bodies)
    err = json.loads(reply.bodies[0])["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err and "code" in err
    return err  # type: ignore[no-any-return]


def _clear_4xx_or_closed(reply: Reply) -> None:
    assert reply.closed or (reply.statuses and 400 <= reply.statuses[0] < 500), (
        reply.statuses,
        reply.bodies,
    )


# -- request lines and headers ------------------------------------------------------------------

BAD_LINES = {
    "garbage": b"GARBAGE\r\n\r\n",
    "no target": b"GET\r\n\r\n",
    "http/9.9": b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    "tls hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
    "nul in target": b"GET /he\x00lthz HTTP/1.1\r\nHost: x\r\n\r\n",
    "64 KiB target": b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "bare LF": b"GET /healthz HTTP/1.1\nHost: x\n\n",
    "negative length": b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    "two lengths": b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",
    "length and chunked": b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_request_line_or_framing_gets_a_4xx_or_a_close(gw: Gateway, case: str) -> None:
    """Bytes that are not an HTTP/1.1 request: a 4xx or a closed connection."""
    reply = _exchange(gw, case, BAD_LINES[case])
    _clear_4xx_or_closed(reply)


def test_a_flood_of_header_fields_gets_a_4xx_or_a_close(gw: Gateway) -> None:
    """10,000 header fields: refused, not read on."""
    raw = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Flood: 1\r\n" * 10_000 + b"\r\n"
    _clear_4xx_or_closed(_exchange(gw, "10k header fields", raw))


def test_one_huge_header_gets_a_4xx_or_a_close(gw: Gateway) -> None:
    """One 1 MiB header value: refused, not read on."""
    raw = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    _clear_4xx_or_closed(_exchange(gw, "1 MiB header", raw))


def _trickle(gw: Gateway, case: str, head: bytes, byte: bytes) -> tuple[float | None, Reply]:
    """Send `head`, then `byte` every 100 ms (at most 60 times: 6 s, six times the slowloris
    timeout) asking /healthz after each; returns when the gateway answered or closed
    (seconds after `head`, None if it did neither) and what it answered."""
    s = socket.create_connection((gw.host, gw.port), timeout=5)
    reply = Reply()
    worst = 0.0
    try:
        s.sendall(head)
        t0 = time.monotonic()
        s.setblocking(False)
        for _ in range(60):
            try:
                s.send(byte)
            except OSError:
                return time.monotonic() - t0, reply
            worst = max(worst, _healthz(gw, case))
            t_next = time.monotonic() + 0.1
            while time.monotonic() < t_next:  # pace the bytes; watch for an answer or close
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                except ConnectionResetError:
                    data = b""
                if not data:
                    took = time.monotonic() - t0
                    print(f"{case}: closed after {took:.2f} s, statuses {reply.statuses}; "
                          f"worst /healthz {worst * 1000:.1f} ms")  # fmt: skip
                    return took, reply
                reply.feed(data)
                if reply.statuses:
                    took = time.monotonic() - t0
                    print(f"{case}: answered after {took:.2f} s, statuses {reply.statuses}; "
                          f"worst /healthz {worst * 1000:.1f} ms")  # fmt: skip
                    return took, reply
        return None, reply
    finally:
        s.close()


def test_slowloris_headers_get_a_408_at_the_header_timeout(gw: Gateway) -> None:
    """A header byte every 100 ms: 408 and closed once `client_header_timeout` has passed
    since the head's first byte, and /healthz answers throughout."""
    took, reply = _trickle(gw, "slowloris headers", b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"X")
    assert took is not None, "a trickled head was held past 6x its timeout"
    assert _openai_error(reply, 408)["code"] == "request_timeout"


def test_a_trickled_body_gets_a_408_at_the_body_timeout(gw: Gateway) -> None:
    """A body byte every 100 ms: 408 `request_timeout` (OpenAI's shape) once the body has
    had `client_body_timeout` to arrive (found here: the landed gateway held the
    connection, its handler and its buffer for as long as the client went on)."""
    head = _post(b"")[: -len(b"Content-Length: 0\r\n\r\n")] + b"Content-Length: 1000\r\n\r\n"
    took, reply = _trickle(gw, "slowloris body", head, b" ")
    assert took is not None, "a trickled body was held past 6x its timeout"
    assert _openai_error(reply, 408)["code"] == "request_timeout"


# -- pipelining, chunked bodies, Expect ---------------------------------------------------------


def test_two_pipelined_requests_get_two_answers_in_order(gw: Gateway) -> None:
    """Two requests in one write: both answered, in order, on the one connection."""
    health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    bad = _post(b"{", path=CHAT)
    reply = _exchange(gw, "pipelining", health + bad + health, want=3)
    assert reply.statuses == [200, 400, 200], reply.statuses


def _chunked(*chunks: bytes) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(chunks)


BAD_CHUNKS = {
    "not hex": _chunked(b"zz\r\n{}\r\n0\r\n\r\n"),
    "negative": _chunked(b"-2\r\n{}\r\n0\r\n\r\n"),
    "overflowing": _chunked(b"ffffffffffffffffff\r\n{}\r\n0\r\n\r\n"),
    "past the body limit": _chunked(b"7fffffff\r\n" + b"a" * (5 * 1024 * 1024)),
    # then the client shuts its side: a body that never comes (one that is merely slow gets
    # the body timeout's 408)
    "shorter than said": _chunked(b"10\r\n{}\r\n0\r\n\r\n"),
}


@pytest.mark.parametrize("case", list(BAD_CHUNKS))
def test_a_chunked_body_with_a_bad_size_gets_a_4xx_or_a_close(gw: Gateway, case: str) -> None:
    """Chunk sizes that are not hex, negative, past 64 bits or past the body bound."""
    raw = BAD_CHUNKS[case]
    _clear_4xx_or_closed(
        _exchange(gw, f"chunked {case}", raw, wait=5.0, eof=case == "shorter than said")
    )


def test_a_valid_chunked_body_is_read(gw: Gateway) -> None:
    """A well-formed chunked request body reaches the handler (and is answered)."""
    doc = b'{"model":"demo-7b","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    raw = _chunked(b"%x\r\n%s\r\n0\r\n\r\n" % (len(doc), doc))
    assert _exchange(gw, "chunked valid", raw).statuses == [200]


def test_expect_100_continue_is_answered_then_the_body_read(gw: Gateway) -> None:
    """`Expect: 100-continue`: a 100 first (or straight the answer), then the answer."""
    doc = b'{"model":"demo-7b","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    reply = _exchange(gw, "expect 100", _post(doc, b"Expect: 100-continue"), want=2, wait=5.0)
    assert reply.statuses[-1] == 200 and set(reply.statuses) <= {100, 200}, reply.statuses


def test_expect_100_continue_past_the_body_limit_is_refused_unread(gw: Gateway) -> None:
    """A Content-Length past `gateway.max_body_bytes` with `Expect`: 413 without sending
    the body (the client never has to upload it)."""
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: 104857600\r\n\r\n"
    )
    reply = _exchange(gw, "expect 100 too large", raw, wait=5.0)
    assert reply.statuses == [413], reply.statuses  # no 100 Continue first


# -- JSON edge cases ----------------------------------------------------------------------------

MiB = 1 << 20


def _chat_with(content: bytes, extra: bytes = b"") -> bytes:
    return (
        b'{"model":"demo-7b","max_tokens":2,' + extra
        + b'"messages":[{"role":"user","content":' + content + b"}]}"
    )  # fmt: skip


JSON_CASES: dict[str, tuple[bytes, int]] = {
    "nesting 100k deep": (b"[" * 100_000 + b"]" * 100_000, 400),
    "nesting 100k deep in a field": (_chat_with(b"[" * 100_000 + b"]" * 100_000), 400),
    "huge integer": (_chat_with(b'"hi"', b'"max_tokens":' + b"9" * 5000 + b","), 400),
    "1e400": (_chat_with(b'"hi"', b'"temperature":1e400,'), 400),
    "NaN": (_chat_with(b'"hi"', b'"temperature":NaN,'), 400),
    "invalid UTF-8": (_chat_with(b'"\xff\xfe\xc3"'), 400),
    "lone surrogate escape": (_chat_with(b'"\\ud800"'), 400),
    "4 MiB string": (_chat_with(b'"' + b"a" * (4 * MiB) + b'"'), 413),
    "not an object": (b'"just a string"', 400),
    # ~1.4M empty objects under the limit: refused by their count before any parse (a
    # parse of them held the loop ~350 ms; docs/reliability.md prints /healthz meanwhile)
    "4 MiB of {}": (b'{"model":"demo-7b","x":[' + b"{}," * ((4 * MiB - 100) // 3) + b"{}]}", 400),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_json_edge_cases_get_a_clear_4xx_in_openais_shape(gw: Gateway, case: str) -> None:
    """Deep nesting, huge numbers, NaN, invalid UTF-8, a body past the limit: OpenAI's
    error shape with a 4xx, the gateway unharmed."""
    body, status = JSON_CASES[case]
    _openai_error(_exchange(gw, case, _post(body)), status)


def test_a_string_just_under_the_body_limit_is_parsed_and_answered(gw: Gateway) -> None:
    """A 4 MiB body (a string of 4 MiB - 1 KiB) reaches the handler; /healthz meanwhile."""
    body = _chat_with(b'"' + b"a " * ((4 * MiB - 1024) // 2) + b'"')
    reply = _exchange(gw, "4 MiB - 1 KiB string", _post(body), wait=20.0)
    assert reply.statuses and reply.statuses[0] in (200, 400), reply.statuses


def test_duplicate_keys_take_the_last_value(gw: Gateway) -> None:
    """Duplicate keys are read as JSON parsers do (the last wins), not rejected: the
    model named last is the one routed."""
    body = (
        b'{"model":"nope","model":"demo-7b","max_tokens":2,'
        b'"messages":[{"role":"user","content":"hi"}]}'
    )
    reply = _exchange(gw, "duplicate keys", _post(body))
    assert reply.statuses == [200], reply.bodies
