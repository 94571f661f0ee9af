"""The lean server of the proxied POSTs (`proxy/client_conn.py`), beside aiohttp.

`parse_head` is pure and checked as such: what it serves, and every head it leaves to
aiohttp. Then a real `pulsegate serve` on loopback, over raw sockets, so the bytes on the
wire are what is checked: which server answered (aiohttp's answers carry its `Server`
header, the lean server sends none), one connection passing between the two in both
directions, pipelined requests answered in order, a head and body arriving in pieces, an
early answer closing the connection, the idle timer kept off a long stream and back after
it, and a client that leaves mid-stream freeing its backend.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import pytest
from aiohttp import web

from pulsegate.proxy.client_conn import MAX_HEAD, MORE, Head, lean_usable, parse_head
from pulsegate.proxy.request import API
from support import Gateway, Reply, Sim, backend_entry, fast_probes, wait_until
from support import read_replies as read

PATHS = {p.encode(): p for p in API}
BODY = b'{"model":"demo-7b","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
STREAM = (
    b'{"model":"demo-7b","messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"stream":true}'
)


def post(body: bytes = BODY, path: bytes = b"/v1/chat/completions", extra: bytes = b"") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n%b"
        b"Content-Length: %d\r\n\r\n%b" % (path, extra, len(body), body)
    )


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"


# -- parse_head ----------------------------------------------------------------------------


def test_a_plain_post_is_served_here() -> None:
    raw = post()
    head = parse_head(raw + b"GET", PATHS, 1000)
    assert head is not None and head is not MORE
    assert head.path == "/v1/chat/completions"
    assert head.headers == {
        "host": "gw",
        "content-type": "application/json",
        "content-length": str(len(BODY)),
    }
    assert head.length == len(BODY) and not head.close
    assert raw[head.end :] == BODY


def test_the_worked_example() -> None:
    raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    head = parse_head(raw, PATHS, 10)
    assert _fields(head) == (
        "/v1/chat/completions",
        {"host": "x", "content-length": "2"},
        2,
        False,
        66,
    )
    assert raw[66:] == b"{}"
    bare = parse_head(b"POST /v1/embeddings HTTP/1.1\r\n\r\n", PATHS, 10)
    assert _fields(bare) == ("/v1/embeddings", {}, 0, False, 32)


def _fields(head: Head | None) -> tuple[object, ...]:
    assert head is not None and head is not MORE
    return head.path, head.headers, head.length, head.close, head.end


def test_repeated_headers_keep_the_first_and_names_are_lowered() -> None:
    raw = post(extra=b"X-Session-Id: one\r\nx-session-id: two\r\nConnection: keep-alive, Close\r\n")
    head = parse_head(raw, PATHS, 1000)
    assert head is not None and head is not MORE
    assert head.headers["x-session-id"] == "one" and head.close


def test_a_head_not_yet_whole_waits() -> None:
    raw = post()
    for cut in (1, 4, 10, 30, raw.index(b"\r\n\r\n") + 2):
        assert parse_head(raw[:cut], PATHS, 1000) is MORE, cut


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n\r\n",
        b"G",  # not a POST, known from the first byte
        GET_MODELS,
        post(path=b"/v1/models"),
        post(path=b"/v1/chat/completions?x=1"),
        post().replace(b"HTTP/1.1", b"HTTP/1.0"),
        post(extra=b"Transfer-Encoding: chunked\r\n"),
        post(extra=b"Expect: 100-continue\r\n"),
        post(extra=b"Upgrade: h2c\r\nConnection: Upgrade\r\n"),
        post(extra=b"Content-Length: 3\r\n"),  # two lengths
        post().replace(b"Content-Length: ", b"Content-Length: +"),
        post(extra=b"Bad Name: x\r\n"),
        post(extra=b"X-Nul: a\x00b\r\n"),
        post(extra=b" folded\r\n"),
        post(body=b"x" * 1001),  # past max_body: aiohttp's 413
        b"POST /v1/chat/completions HTTP/1.1\r\n" + b"X-Pad: " + b"a" * MAX_HEAD,
    ],
)
def test_anything_else_is_aiohttps(raw: bytes) -> None:
    assert parse_head(raw, PATHS, 1000) is None


async def test_aiohttp_still_has_the_idle_timer_the_lean_server_holds_off() -> None:
    """Fails on an aiohttp that renamed them (the gateway would log an error and serve
    every request with aiohttp)."""

    async def h(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    assert lean_usable(web.Server(h)())


# -- a real gateway ------------------------------------------------------------------------


@pytest.fixture
def gw(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> Gateway:
    sim = start_sim("a", "--itl-ms", "20")
    g = start_gateway(
        {
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
            "gateway": {"client_idle_timeout": 1.0, "client_body_timeout": 1.0},
        }
    )
    g.wait_all_ready()
    return g


def _conn(gw: Gateway) -> socket.socket:
    return socket.create_connection((gw.host, gw.port), timeout=10)


def _lean(reply: Reply, i: int) -> bool:
    return "server" not in reply.headers[i]


def test_one_connection_passes_between_the_servers(gw: Gateway) -> None:
    """POST (lean), GET /v1/models (aiohttp), POST (lean), GET /metrics (aiohttp) on one
    keep-alive connection: each answered whole, by the server it belongs to."""
    s = _conn(gw)
    reply = Reply()
    for i, (req, lean) in enumerate(
        [
            (post(), True),
            (GET_MODELS, False),
            (post(), True),
            (b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n", False),
        ]
    ):
        s.sendall(req)
        read(s, reply, i + 1)
        assert reply.statuses[i] == 200 and _lean(reply, i) is lean, (i, reply.headers[i])
    assert json.loads(reply.bodies[0])["choices"][0]["message"]["content"]
    assert json.loads(reply.bodies[1])["data"][0]["id"] == "demo-7b"
    assert reply.headers[0]["content-length"] == str(len(reply.bodies[0]))
    assert not reply.closed
    s.close()


def test_pipelined_requests_are_answered_in_order(gw: Gateway) -> None:
    """Two POSTs (lean), a GET and a POST in one write: the GET and what follows it went to
    aiohttp with it, in order, and aiohttp answers them both."""
    s = _conn(gw)
    bad = post(b'{"model":"demo-7b"}')
    s.sendall(post() + bad + GET_MODELS + post())
    reply = read(s, Reply(), 4)
    assert reply.statuses == [200, 400, 200, 200]
    assert [_lean(reply, i) for i in range(4)] == [True, True, False, False]
    assert json.loads(reply.bodies[1])["error"]["code"] == "missing_messages"
    s.close()


def test_a_head_behind_requests_aiohttp_holds_waits_for_them(gw: Gateway) -> None:
    """Forty pipelined `GET /metrics` (aiohttp's) to a client with a 4 KiB receive buffer:
    aiohttp soon waits for the client to read, holding the rest. A POST sent then (one the
    lean server answers at once: a 400) is answered after all forty, in the order asked
    (the lean server leaves a head to aiohttp while aiohttp holds requests not yet
    answered)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect((gw.host, gw.port))
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n" * 40)
    reply = Reply()
    reply.feed(s.recv(1024))  # aiohttp is writing; it cannot have written 40 answers
    s.sendall(post(b'{"model":"demo-7b"}'))
    read(s, reply, 41, wait=20)
    assert reply.statuses == [200] * 40 + [400]
    assert all(b"pulsegate_" in b for b in reply.bodies[:40])
    assert json.loads(reply.bodies[40])["error"]["code"] == "missing_messages"
    s.close()


def test_a_head_and_body_in_pieces(gw: Gateway) -> None:
    raw = post()
    s = _conn(gw)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cuts = [3, 20, raw.index(b"\r\n\r\n") + 4, len(raw) - 5, len(raw)]
    at = 0
    for c in cuts:
        s.sendall(raw[at:c])
        at = c
        time.sleep(0.02)  # separate reads on the gateway's side; nothing waits on it
    reply = read(s, Reply(), 1)
    assert reply.statuses == [200] and _lean(reply, 0)
    s.close()


def test_a_body_that_stops_gets_408_and_the_connection_closes(gw: Gateway) -> None:
    raw = post()
    s = _conn(gw)
    s.sendall(raw[:-10])
    reply = read(s, Reply(), 2, wait=10)
    assert reply.statuses == [408] and reply.closed
    assert reply.headers[0]["connection"] == "close"
    s.close()


def test_a_chunked_body_is_aiohttps_and_the_answer_the_same_as_the_lean_servers(
    gw: Gateway,
) -> None:
    """A chunked upload is aiohttp's, the next plain POST the lean server's; a backend's
    answer (a `Whole`) reaches the client the same through both: body, type, the gateway's
    headers, length."""
    s = _conn(gw)
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)
    )
    s.sendall(chunked)
    reply = read(s, Reply(), 1)
    assert reply.statuses == [200] and not _lean(reply, 0)
    s.sendall(post())  # after the answer: a head behind one aiohttp holds is aiohttp's
    read(s, reply, 2)
    s.close()
    assert reply.statuses == [200, 200] and _lean(reply, 1)
    for body, head in zip(reply.bodies, reply.headers, strict=True):
        doc = json.loads(body)
        assert doc["object"] == "chat.completion" and doc["choices"][0]["message"]["content"]
        assert head["content-type"].startswith("application/json")
        assert head["x-pulsegate-attempts"] == "1" and head["x-pulsegate-backend"]
        assert int(head["content-length"]) == len(body)


def test_a_long_stream_outlives_the_idle_timer_which_then_closes(gw: Gateway) -> None:
    """`client_idle_timeout` is 1 s; a 100-token stream at 20 ms a token takes 2 s and is
    whole; the connection, idle after it, is closed by the gateway."""
    s = _conn(gw)
    s.sendall(post(STREAM % 100))
    reply = read(s, Reply(), 1, wait=20)
    assert reply.statuses == [200] and _lean(reply, 0)
    events = [e for e in reply.bodies[0].split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) >= 100
    assert not reply.closed
    read(s, reply, 2, wait=10)  # nothing more comes: the gateway closes it when idle
    assert reply.closed and len(reply.statuses) == 1
    s.close()


def test_a_client_leaving_mid_stream_frees_the_backend(gw: Gateway) -> None:
    s = _conn(gw)
    s.sendall(post(STREAM % 2000))
    s.settimeout(10)
    got = b""
    while got.count(b"\n\n") < 3:
        got += s.recv(65536)
    assert b"server:" not in got.split(b"\r\n\r\n")[0].lower()
    s.close()
    wait_until(lambda: gw.backends()["a"]["inflight"] == 0, timeout=5, what="backend freed")


def test_connection_close_is_honoured(gw: Gateway) -> None:
    s = _conn(gw)
    s.sendall(post(extra=b"Connection: close\r\n"))
    reply = read(s, Reply(), 2)
    assert reply.statuses == [200] and reply.closed and _lean(reply, 0)
    assert reply.headers[0]["connection"] == "close"
    s.close()
